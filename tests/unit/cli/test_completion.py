"""Shell completion and the man page are generated from the parser (cli/completion.py): every
subcommand and every option of each is in all three, and the scripts parse (issue 26, point 11)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from llmsupervisor.cli import completion
from llmsupervisor.cli import main as cli


def _subcommands() -> dict[str, list[str]]:
    _, subs = completion.commands(cli._parser())
    return {c.name: [flag for o in c.all_options for flag in o.flags] for c in subs}


def _nested() -> dict[str, dict[str, list[str]]]:
    """The subcommands of a subcommand (`gpu release|take-back|clear`) and their options."""
    _, subs = completion.commands(cli._parser())
    return {
        c.name: {sub.name: [flag for o in sub.options for flag in o.flags] for sub in c.subcommands}
        for c in subs
        if c.subcommands
    }


def test_a_subcommands_own_subcommands_are_read() -> None:
    nested = _nested()
    assert set(nested["gpu"]) == {"release", "take-back", "clear"}
    assert "--window" in nested["gpu"]["release"] and "--json" in nested["gpu"]["take-back"]


def test_the_parser_is_read_whole() -> None:
    subs = _subcommands()
    for name in ("run", "check-config", "status", "restart", "drain", "stop", "start", "reload", "events"):
        assert name in subs
    assert {"completion", "man"} <= set(subs)
    assert "--watch" in subs["status"] and "--output" in subs["status"]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_every_subcommand_and_option_is_completed(shell: str) -> None:
    script = completion.bash(cli._parser()) if shell == "bash" else completion.zsh(cli._parser())
    for name, flags in _subcommands().items():
        assert f"{name})" in script, f"{name} has no case in the {shell} completion"
        for flag in flags:
            assert flag in script, f"{name} {flag} missing from the {shell} completion"


def test_the_man_page_has_every_subcommand_and_option() -> None:
    page = completion.man(cli._parser(), date="2026-01-01")
    assert page.splitlines()[1].startswith('.TH LLM\\-SUPERVISOR 1 "2026-01-01"')
    for name, flags in _subcommands().items():
        assert f".SS {name.replace('-', chr(92) + '-')}" in page, name
        for flag in flags:
            assert f"\\fB{flag.replace('-', chr(92) + '-')}\\fR" in page, (name, flag)
    for name, subs in _nested().items():
        for sub in subs:
            assert f".SS {name} {sub.replace('-', chr(92) + '-')}" in page, (name, sub)


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_a_subcommands_own_subcommands_are_completed(shell: str) -> None:
    script = completion.bash(cli._parser()) if shell == "bash" else completion.zsh(cli._parser())
    gpu = next(line for line in script.splitlines() if line.strip().startswith("gpu)"))
    for sub, flags in _nested()["gpu"].items():
        assert sub in gpu
        for flag in flags:
            assert flag in gpu, (sub, flag)


def test_the_bash_script_parses(tmp_path: Path) -> None:
    path = tmp_path / "llm-supervisor.bash"
    path.write_text(completion.bash(cli._parser()))
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="no zsh on this machine")
def test_the_zsh_script_parses(tmp_path: Path) -> None:
    path = tmp_path / "_llm-supervisor"
    path.write_text(completion.zsh(cli._parser()))
    subprocess.run(["zsh", "-n", str(path)], check=True)


@pytest.mark.skipif(shutil.which("groff") is None, reason="no groff on this machine")
def test_the_man_page_renders_without_warnings(tmp_path: Path) -> None:
    path = tmp_path / "llm-supervisor.1"
    path.write_text(completion.man(cli._parser()))
    done = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z", str(path)], capture_output=True, text=True, check=True
    )
    assert done.stderr == ""


def test_the_commands_print_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["completion", "bash"]) == 0
    assert "complete -F _llm_supervisor llm-supervisor" in capsys.readouterr().out
    assert cli.main(["completion", "zsh"]) == 0
    assert capsys.readouterr().out.startswith("#compdef llm-supervisor")
    assert cli.main(["man"]) == 0
    assert ".SH COMMANDS" in capsys.readouterr().out


def test_the_man_page_is_dated_by_source_date_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A package build that sets SOURCE_DATE_EPOCH gets the same page from the same sources
    (packaging/build puts this page in the .deb and the .rpm)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")  # 2026-01-01 00:00:00 UTC
    assert '"2026-01-01"' in completion.man(cli._parser()).splitlines()[1]
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "not a number")
    assert '"2026-01-01"' not in completion.man(cli._parser()).splitlines()[1]
