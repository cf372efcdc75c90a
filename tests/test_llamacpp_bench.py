"""benchmarks/generate_vs_llamacpp.py: the work both engines get (pure helpers, no llama_cpp needed) and, where
llama-cpp-python is installed, a tiny end-to-end run of the comparison."""

import json
import re

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("generate_vs_llamacpp")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama checkpoint whose byte tokenizer has one merge, "a" "b" -> "ab" (in the place of byte 0xFF, so
    every id stays where it was): llama.cpp refuses a BPE vocabulary without merges, and the GGUF writer leaves an
    empty merges list out of the file."""
    import json

    from grpo_engine.model.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama3", rope_scaling=None)
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["ab"] = vocab.pop("\u00ff")  # byte 0xFF's token
    data["model"]["merges"] = [["a", "b"]]
    (path / "tokenizer.json").write_text(json.dumps(data))
    return path


def test_prefill_puts_each_prompt_once_in_all_its_samples_sequences(bench):
    """Prompt p's tokens at positions 0..len-1 belong to sequences p*G..p*G+G-1 (their KV cells are shared), and
    only each prompt's last token asks for logits."""
    entries = bench.prefill_entries([[5, 6, 7], [8, 9]], group=2)
    assert entries == [(5, 0, (0, 1), False), (6, 1, (0, 1), False), (7, 2, (0, 1), True),
                       (8, 0, (2, 3), False), (9, 1, (2, 3), True)]
    assert bench.logits_rows([[5, 6, 7], [8, 9]], group=2) == [2, 2, 4, 4]  # the rows marked True above
    assert bench.logits_rows([[1], [2, 3, 4]], group=3) == [0, 0, 0, 3, 3, 3]


def test_context_holds_each_prompt_once_and_every_samples_tokens(bench):
    assert bench.context_size([[5, 6, 7], [8, 9]], group=2, new=4) == 5 + 4 * 4


def test_demo_prompts_are_the_demo_tasks_training_prompts_as_the_trainer_renders_them(bench, tiny_ckpt_factory):
    """The work is `grpo demo --real`'s: its instruct template and instruction (demo_real.yaml), 2-digit sums,
    chat-templated (the tiny byte tokenizer decodes back to the text exactly)."""
    from grpo_engine.model.loading import load_tokenizer

    tok = load_tokenizer(tiny_ckpt_factory("llama3", rope_scaling=None))
    prompts = bench.demo_prompts(tok, 3)
    texts = [tok.decode(p) for p in prompts]
    assert len(texts) == 3 and len(set(texts)) == 3  # three different problems
    for text in texts:
        assert re.search(r"What is [1-9]\d \+ [1-9]\d\?\n\nReply with just the number\.", text), text
        assert text.rstrip().endswith("assistant<|end_header_id|>")  # the generation prompt, no prefill


def test_demo_prompts_refuse_more_prompts_than_the_task_has(bench, tiny_ckpt, tmp_path):
    from grpo_engine.model.loading import load_tokenizer

    recipe = tmp_path / "r.yaml"
    recipe.write_text("task:\n  name: arithmetic\n  options:\n    n_train: 3\n    n_test: 2\n")
    with pytest.raises(SystemExit, match="--prompts 5: r.yaml's task has only 3 training prompts"):
        bench.demo_prompts(load_tokenizer(tiny_ckpt), 5, recipe)


def test_the_comparison_prints_one_row_per_precision_last(bench, tiny_llama, capsys):
    """Both engines on a tiny Llama model's F32 and BF16 exports: the last line is the JSON list the issue asks
    for, and both engines generated P x G x T tokens (the row is refused otherwise)."""
    pytest.importorskip("llama_cpp")
    rows = bench.main(["--model", str(tiny_llama), "--prompts", "2", "--group", "3", "--max-new", "5",
                       "--threads", "2"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == rows and [r["precision"] for r in last] == ["f32", "bf16"]
    for r in last:
        assert r["new_tokens"] == 2 * 3 * 5 and r["ours_tokens_per_s"] > 0 and r["llamacpp_tokens_per_s"] > 0
        assert r["ours_tokens_per_s"] == pytest.approx(r["new_tokens"] / r["ours_s"])


def test_llama_cpp_is_a_benchmark_peer_not_a_dependency():
    """No module of grpo_engine imports llama_cpp (function bodies included); pyproject names it only in its own
    extra."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    importers = []
    for path in (root / "grpo_engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            importers += [str(path) for n in names if n.split(".")[0] == "llama_cpp"]
    assert importers == []
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert [name for name, reqs in extras.items() if any(r.startswith("llama-cpp-python") for r in reqs)] == \
        ["llamacpp"]
    assert not [r for r in project["dependencies"] if r.startswith("llama-cpp-python")]


def test_llamacpp_batches_give_the_logits_of_each_prompt_and_sample(bench, tiny_llama, tmp_path):
    """The shared-prompt layout computes what it should: llama.cpp's logits on the F32 export after the prefill
    (each prompt's last token) and after one step (each sample's own token at its position) equal our model's on
    the same ids, within float32 summation-order differences. Wrong positions or sequence ids would not."""
    pytest.importorskip("llama_cpp")
    import torch

    from grpo_engine.model.loading import load_model

    gguf = bench.export_precision(str(tiny_llama), "f32", tmp_path)
    ours = load_model(gguf)
    vocab = ours.config.vocab_size
    prompts, group = [[256, 72, 105, 33, 10], [256, 50, 43, 50]], 2  # 256: <|begin_of_text|>
    engine = bench.LlamaCpp(gguf, 2, prompts, group, new=3)

    def ours_last(ids):
        with torch.no_grad():
            return ours(torch.tensor([ids]))[0, -1].double()

    try:
        engine.prefill()
        for s, row in enumerate(bench.logits_rows(prompts, group)):
            got = torch.tensor(engine.logits(row, vocab), dtype=torch.float64)
            torch.testing.assert_close(got, ours_last(prompts[s // group]), atol=2e-4, rtol=1e-4)
        tokens = [65, 66, 67, 68]  # a different token for each of the 4 samples
        engine.step(tokens, 1)
        for s, tok in enumerate(tokens):
            got = torch.tensor(engine.logits(s, vocab), dtype=torch.float64)
            torch.testing.assert_close(got, ours_last(prompts[s // group] + [tok]), atol=2e-4, rtol=1e-4)
    finally:
        engine.close()
