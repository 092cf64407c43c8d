"""`launcher:` against the real vLLM CPU build: it keeps ``max-num-active-seqs`` out of its compile
key, so that ladder step is warm."""

from __future__ import annotations

import subprocess

import pytest


@pytest.mark.vllm_cpu
def test_the_real_vllm_keeps_max_num_active_seqs_out_of_its_compile_key() -> None:
    """Against vLLM 0.32's own SchedulerConfig.compute_hash: max-num-seqs and
    max-num-batched-tokens change the torch.compile cache key, max-num-active-seqs does not."""
    from tests.lib.vllm_env import vllm_python

    probe = (
        "from vllm.config import SchedulerConfig as S\n"
        "kw = dict(max_model_len=256, is_encoder_decoder=False)\n"
        "base = S(max_num_seqs=64, max_num_batched_tokens=2048, **kw).compute_hash()\n"
        "def same(**changed): return base == S(**{**kw, 'max_num_seqs': 64, 'max_num_batched_tokens': 2048,"
        " **changed}).compute_hash()\n"
        "print(same(max_num_active_seqs=8), same(max_num_seqs=32), same(max_num_batched_tokens=1024))\n"
    )
    done = subprocess.run([str(vllm_python()), "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["True", "False", "False"]
