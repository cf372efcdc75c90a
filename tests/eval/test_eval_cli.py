"""`grpo eval` / `grpo generate` / `grpo plot` end to end on a tiny random checkpoint, and their bad-input errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_engine.cli import main
from grpo_engine.eval.cli import parse_task_options, printable
from grpo_engine.model.loading import load_model, load_tokenizer
from grpo_engine.rollout import SamplingParams, generate
from grpo_engine.tasks import R1_PREFILL, R1_SYSTEM_PROMPT, Example, make_task, render_prompt

REPO = Path(__file__).resolve().parents[2]
EVAL_FAST = ["--task", "arithmetic", "--n", "2", "--k", "1,2", "--max-new", "8", "--max-examples", "3"]


def test_eval_end_to_end_json_and_table(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "r" / "report.json"
    assert main(["eval", str(tiny_ckpt), *EVAL_FAST, "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout is exactly one JSON document
    assert json.loads(out.read_text()) == doc
    assert doc["model"] == str(tiny_ckpt) and doc["task"] == "arithmetic" and doc["split"] == "test"
    s = doc["summary"]
    assert set(s) == {"num_problems", "samples_per_problem", "pass@1", "pass@2", "maj@1", "maj@2", "format_rate",
                      "mean_length", "truncation_rate", "mean_reward", "reward_errors"}
    assert (s["num_problems"], s["samples_per_problem"]) == (3, 2)
    samples = [x for p in doc["problems"] for x in p["samples"]]
    assert len(samples) == 6 and all(1 <= x["num_tokens"] <= 8 for x in samples)
    assert all(x["num_tokens"] == 8 for x in samples if x["truncated"])  # truncated = hit --max-new
    # the summary is the mean of the per-sample / per-problem records it was built from
    assert s["mean_length"] == pytest.approx(sum(x["num_tokens"] for x in samples) / 6)
    assert s["truncation_rate"] == pytest.approx(sum(x["truncated"] for x in samples) / 6)
    assert s["pass@1"] == pytest.approx(sum(p["num_correct"] for p in doc["problems"]) / 6)
    first3 = make_task("arithmetic").examples("test")[:3]
    assert [p["question"] for p in doc["problems"]] == [e.question for e in first3]
    table = captured.err.splitlines()
    header = table.index("| task | problems | n | pass@1 | pass@2 | maj@1 | maj@2 | format | mean length | truncated "
                         "| mean reward |")
    assert table[header + 2].startswith("| arithmetic | 3 | 2 | ")


def fake_training_checkpoint(tiny_ckpt, tmp_path) -> Path:
    """run_dir/checkpoints/step-000002/{model/, trainer_state.pt, config.yaml} as `grpo train` lays it out (before
    0.1: without a manifest, which needs a config.yaml to be evaluated)."""
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    shutil.copytree(tiny_ckpt, step / "model")
    (step / "trainer_state.pt").write_bytes(b"")
    shutil.copy(Path(__file__).resolve().parents[2] / "configs" / "tiny_arithmetic.yaml", step / "config.yaml")
    return step


def test_eval_accepts_checkpoint_dir_its_model_dir_and_run_dir(tiny_ckpt, tmp_path, capsys):
    step = fake_training_checkpoint(tiny_ckpt, tmp_path)
    docs = []
    for path in (step, step / "model", tmp_path / "run"):
        args = ["eval", str(path), "--task", "arithmetic", "--temperature", "0", "--max-new", "4", "--max-examples",
                "2", "--json"]
        assert main(args) == 0
        docs.append(json.loads(capsys.readouterr().out))
    assert {d["model"] for d in docs} == {str(step / "model")}
    assert docs[0]["summary"] == docs[1]["summary"] == docs[2]["summary"]  # greedy: same model, same result
    assert docs[0]["config"]["n"] == 1 and docs[0]["config"]["ks"] == [1]
    assert "greedy" in docs[0]["notes"][0]


def run_error(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_bad_inputs_name_the_file_and_the_fix(tiny_ckpt, tmp_path, capsys):
    missing = tmp_path / "gsm8k_missing.jsonl"
    err = run_error(["eval", str(tiny_ckpt), "--task", "gsm8k", "--data", str(missing)], capsys)
    assert f"--data {missing}: no such file" in err and "pass a local .jsonl" in err

    no_tok = tmp_path / "no_tok"
    shutil.copytree(tiny_ckpt, no_tok)
    (no_tok / "tokenizer.json").unlink()
    err = run_error(["eval", str(no_tok), "--task", "arithmetic"], capsys)
    assert f"{no_tok / 'tokenizer.json'} not found" in err and "--tokenizer BASE_MODEL_DIR" in err

    err = run_error(["eval", str(tmp_path / "nowhere"), "--task", "arithmetic"], capsys)
    assert "nowhere does not exist" in err and "checkpoint" in err
    err = run_error(["eval", str(tmp_path), "--task", "arithmetic"], capsys)
    assert "config.json not found" in err
    err = run_error(["eval", str(tiny_ckpt), "--task", "arithmetic", "--data", str(missing)], capsys)
    assert "generates its problems and reads no data file; drop --data" in err
    err = run_error(["eval", str(tiny_ckpt), "--task", "arithmetic", "--task-option", "digts=3"], capsys)
    assert "unknown option(s) ['digts']" in err and "'digits'" in err
    err = run_error(["eval", str(tiny_ckpt), "--task", "arithmetic", "--n", "2", "--k", "1,4"], capsys)
    assert "k=4 needs at least that many samples but n=2" in err

    with pytest.raises(SystemExit) as exc:
        main(["eval", str(tiny_ckpt), "--task", "gsm9k"])
    assert exc.value.code == 2 and "invalid choice: 'gsm9k'" in capsys.readouterr().err


def test_bad_out_and_missing_custom_data_fail_before_sampling(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """--out naming a directory was found when the report was written, after the whole evaluation; --task
    custom without --data blamed a placeholder path meant for `grpo generate`."""
    import grpo_engine.eval.evaluate as evaluate_module

    monkeypatch.setattr(evaluate_module, "evaluate", lambda *a, **k: pytest.fail("sampled before checking"))
    err = run_error(["eval", str(tiny_ckpt), *EVAL_FAST, "--out", str(tmp_path)], capsys)
    assert f"--out {tmp_path} is a directory; name a file" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = run_error(["eval", str(tiny_ckpt), *EVAL_FAST, "--out", str(blocker / "r.json")], capsys)
    assert f"--out {blocker / 'r.json'}: cannot create its folder" in err
    err = run_error(["eval", str(tiny_ckpt), "--task", "custom"], capsys)
    assert "--task custom needs --data FILE" in err and "generate" not in err
    err = run_error(["eval", str(tiny_ckpt), *EVAL_FAST, "--top-p", "0"], capsys)
    assert "top_p=0.0 must be in (0, 1]" in err


def test_bad_device_and_option_types_are_one_line_errors(tiny_ckpt, capsys):
    """--device tpu was blamed on a truncated safetensors file, --device cuda without a GPU and
    --task-option digits=x were tracebacks."""
    err = run_error(["generate", str(tiny_ckpt), "1+1=", "--device", "tpu"], capsys)
    assert "--device 'tpu' is not a device name; use cpu, cuda or cuda:N" in err and "truncated" not in err
    if not torch.cuda.is_available():
        err = run_error(["eval", str(tiny_ckpt), "--task", "arithmetic", "--device", "cuda"], capsys)
        assert "--device cuda but no CUDA device is visible; use --device cpu" in err
    err = run_error(["generate", str(tiny_ckpt), "1+1=", "--task-option", "digits=x"], capsys)
    assert "task option digits='x' must be an integer" in err
    assert main(["generate", str(tiny_ckpt), "1+1=", "--device", "cpu:0", "--max-new", "2"]) == 0


@pytest.mark.slow  # a fresh interpreter importing torch: ~3 s alone, more on a loaded machine
def test_bad_input_in_a_real_process_has_no_traceback(tiny_ckpt, tmp_path):
    no_tok = tmp_path / "no_tok"
    shutil.copytree(tiny_ckpt, no_tok)
    (no_tok / "tokenizer.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "grpo_engine.cli", "eval", str(no_tok), "--task", "arithmetic"],
                          capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("grpo eval: error: ") and "tokenizer.json not found" in proc.stderr


def test_generate_prints_the_sampled_completions(tiny_ckpt, capsys):
    argv = ["generate", str(tiny_ckpt), "12+35=", "--n", "2", "--max-new", "12", "--seed", "3", "--answer", "47",
            "--device", "cpu"]  # the reference below samples on CPU
    assert main(argv) == 0
    out = capsys.readouterr().out
    # the same sampling done by hand: prompt rendered by the arithmetic template, same params and seed
    model, tok = load_model(tiny_ckpt), load_tokenizer(tiny_ckpt)
    task = make_task("arithmetic")
    prompt = tok.encode(render_prompt(task, tok, Example("cli", "12+35=", "47")))
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=12, stop_token_ids=tok.eos_token_ids)
    ref = generate(model, [prompt], params, seed=3, tokenizer=tok)
    for i, ids in enumerate(ref.completion_ids):
        text = printable(tok.decode(ids, skip_special_tokens=True))
        assert f"--- sample {i + 1}/2 ({len(ids)} tokens, {ref.finish_reason[i]}) ---\n{text}\n" in out
    assert out.count("correct: no | reward: 0.000]") == 2


def test_generate_custom_template_without_data(tiny_ckpt, capsys):
    r1 = [f"--task-option={k}={json.dumps(v)}"
          for k, v in (("system_prompt", R1_SYSTEM_PROMPT), ("prefill", R1_PREFILL))]
    argv = ["generate", str(tiny_ckpt), "What is 6*7?", "--task", "custom", "--max-new", "4", "--show-prompt",
            "--temperature", "0", *r1]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>system\nA conversation between User and Assistant" in out
    assert "What is 6*7?<|im_end|>" in out and "Let me solve this step by step.\n<think>" in out
    assert "(pass --answer REF to score correctness)" in out


def test_task_options_and_printable():
    assert parse_task_options(["digits=3", "operations=[+, '*']", "format=partial", "system_prompt=null"]) == {
        "digits": 3, "operations": ("+", "*"), "format": "partial", "system_prompt": None}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_task_options(["digits"])
    assert printable("ok\x1b[2J\n\tend\x00") == "ok\\x1b[2J\n\tend\\x00"


def test_plot_writes_png(tmp_path, capsys):
    rows = [{"step": s, "reward_mean": s / 10, "completion_len_mean": 10 + s} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(tmp_path)]) == 0
    png = Path(capsys.readouterr().out.strip())
    assert png == tmp_path / "curves.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_eval_of_a_run_uses_its_task_and_options(tiny_ckpt, tmp_path, capsys):
    """`grpo eval RUN_DIR` evaluates on the run's own task, data and options (here a byte-level template and
    digits=1), without repeating them; --k defaults are clamped to --n."""
    from grpo_engine.config import load_config
    from grpo_engine.train.loop import train

    cfg = load_config(REPO / "configs/tiny_arithmetic.yaml", [f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'r'}",
                                                             "schedule.steps=1", "task.options.template=Q {a}{op}{b}"])
    train(cfg)
    assert main(["eval", str(tmp_path / "r"), "--n", "2", "--max-new", "4", "--max-examples", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["task"] == "arithmetic" and set(doc["summary"]) >= {"pass@1", "pass@2"}
    assert "pass@4" not in doc["summary"]
    want = make_task("arithmetic", template="Q {a}{op}{b}", digits=1, n_train=64, n_test=16).examples("test")[:2]
    assert [p["question"] for p in doc["problems"]] == [e.question for e in want]


def test_eval_and_generate_with_tools(tiny_ckpt, tmp_path, capsys):
    """A checkpoint whose run trained with tools is evaluated with them (the report gains tool columns);
    --tools none turns them off, --tools NAMES turns them on for a plain model."""
    step = tmp_path / "step-000001"
    shutil.copytree(tiny_ckpt, step / "model")
    (step / "config.yaml").write_text("tools:\n  enabled: true\n  names: [calculator]\n  max_turns: 2\n"
                                      "  max_tokens: 24\n  format: undeclared\n")
    assert main(["eval", str(step), *EVAL_FAST, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert 0.0 <= summary["tool_call_rate"] <= 1.0 and summary["tool_errors"] >= 0
    assert 0.0 <= summary["tool_error_rate"] <= 1.0
    assert main(["eval", str(step), *EVAL_FAST, "--json", "--tools", "none"]) == 0
    assert "tool_call_rate" not in json.loads(capsys.readouterr().out)["summary"]

    argv = ["generate", str(tiny_ckpt), "a=287 b=232 a*b=", "--tools", "calculator", "--max-new", "6", "--n", "2",
            "--task-option", "template=a={a} b={b} a{op}b=", "--task-option", "named_operands=true", "--show-prompt"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("--- trajectory ") == 2 and "tool calls" in out
    assert "--- prompt ---\n<|im_start|>system\n# Tools\n" in out  # the prompt the trajectories had: tools declared
    assert main(["generate", str(tiny_ckpt), "1+1=", "--tools", "shell"]) == 2  # refused before loading
    assert "unknown tool 'shell'; choose one of ['calculator', 'check_countdown']" in capsys.readouterr().err


def test_arithmetic_reads_its_own_questions_back():
    task = make_task("arithmetic", template="a={a} b={b} a{op}b=", named_operands=True)
    ex = task.parse_question(" a=287 b=232 a*b= ", "66584")
    assert (ex.a, ex.op, ex.b, ex.answer) == (287, "*", 232, "66584")
    assert task.tool_variables(ex) == {"a": 287, "b": 232}
    assert task.parse_question("a=287 b=232 a/b=") is None  # not an operator of the task family
    assert make_task("arithmetic").parse_question("What is 12 + 35?").b == 35


def test_an_empty_split_is_refused_before_the_model_loads(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """An empty data file loaded the model, printed 'evaluating ...: 0 problems', then failed with an error
    that named neither the file nor the split."""
    import grpo_engine.eval.cli as eval_cli

    monkeypatch.setattr(eval_cli, "load_model_and_tokenizer", lambda *a: pytest.fail("loaded the model first"))
    (tmp_path / "test.jsonl").write_text("")
    err = run_error(["eval", str(tiny_ckpt), "--task", "gsm8k", "--data", str(tmp_path)], capsys)
    fix = "check the data and the task's options, or pick another --split"
    assert err == f"grpo eval: error: split 'test' of gsm8k --data {tmp_path} has no examples; {fix}\n"
    err = run_error(["eval", str(tiny_ckpt), "--task", "arithmetic", "--task-option", "n_test=0"], capsys)
    assert err == f"grpo eval: error: split 'test' of arithmetic has no examples; {fix}\n"


def test_a_failed_report_write_keeps_the_results_and_the_old_report(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """A full disk at --out lost the finished evaluation (nothing printed), truncated the previous report
    and advised `--resume`, which eval does not have."""
    import errno

    out = tmp_path / "report.json"
    out.write_text("previous report\n")

    def full_disk(fd):  # the report's bytes written, then the disk is full when they are flushed
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("os.fsync", full_disk)
    assert main(["eval", str(tiny_ckpt), *EVAL_FAST, "--out", str(out), "--overwrite"]) == 2  # a full disk: yours
    captured = capsys.readouterr()
    assert captured.out.startswith("| task | problems | n | pass@1 |")  # the results were printed first
    assert captured.err.endswith(f"grpo eval: error: --out {out}: No space left on device; nothing written there, "
                                 f"the results are printed above\n")
    assert "--resume" not in captured.err
    assert out.read_text() == "previous report\n" and list(tmp_path.iterdir()) == [out]
