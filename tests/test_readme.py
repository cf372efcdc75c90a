"""README.md stays true: every doc is named in it, it stays short, and its code that runs on a CPU runs here
(the Public API block on a tiny checkpoint, `grpo config show` and `grpo plan --model`)."""

import re
import shlex
from pathlib import Path

import pytest

from grpo_engine.cli import main

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_every_doc_is_named_and_the_readme_is_short():
    docs = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    assert [d for d in docs if d not in README] == []
    assert len(README.splitlines()) <= 200


def test_the_quick_start_test_command_is_the_one_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    command = re.search(r"TEST_CMD='([^']+)'", ci).group(1)
    assert f"\n{command}\n" in README


def test_the_public_api_block_runs(tmp_path, monkeypatch):
    from grpo_engine.model.tiny import make_tiny_checkpoint

    block = README.split("## Public API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", "qwen2", seed=0)
    scope: dict = {}
    exec(block.replace("path/to/Qwen2.5-0.5B-Instruct", str(ckpt)), scope)  # noqa: S102 (our own README)
    assert tuple(scope["logits"].shape[::2]) == (1, scope["model"].config.vocab_size)


@pytest.mark.parametrize("prefix", ["grpo config show ", "grpo plan --model "])
def test_the_readme_commands_that_need_no_download_run(prefix, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    found = re.findall(r"`(" + re.escape(prefix) + r"[^`]+)`", README)
    commands = [c for c in found if not re.search(r"\b[A-Z]{3,}\b", c)]  # not the templates (CONFIG, SHAPE)
    assert commands, f"README names no `{prefix}...` command"
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
        assert capsys.readouterr().out.strip()
