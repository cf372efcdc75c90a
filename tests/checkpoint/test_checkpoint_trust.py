"""Issue 41, items 9-11: resume that means what the user means, task data fingerprinted into each checkpoint, and
checkpoints that prove themselves (checkpoint/verify.py, checkpoint/data_record.py, checkpoint/resume.py).

One tiny run (2 steps, a checkpoint after each, custom task on data.jsonl, paths relative to its folder) is trained
once; each test damages a copy of its folder the way a user, a disk or a copy did, and runs the command line."""

import hashlib
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from grpo_engine.cli import main

REPO = Path(__file__).resolve().parents[2]
STEP1, STEP2 = "run/checkpoints/step-000001", "run/checkpoints/step-000002"


def grpo(*argv, capsys) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def tree(root: Path) -> dict[str, str]:
    """Every file under root with its sha256: what `deletes nothing, changes nothing` compares."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def write_rows(path: Path, n: int, answer=lambda i: str(i)) -> None:
    path.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": answer(i)}) + "\n" for i in range(n)))


@pytest.fixture(scope="module")
def trained(tiny_ckpt_factory, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("trust")
    write_rows(work / "data.jsonl", 8)
    cfg = yaml.safe_load((REPO / "configs/tiny_arithmetic.yaml").read_text())
    cfg.update(run_dir="run", task={"name": "custom", "options": {"data_path": "data.jsonl", "system_prompt": None}})
    cfg["model"]["path"] = str(tiny_ckpt_factory("qwen2"))
    cfg["schedule"]["steps"], cfg["checkpoint"]["keep_last"] = 2, 2
    (work / "train.yaml").write_text(yaml.safe_dump(cfg))
    here = os.getcwd()
    os.chdir(work)
    try:
        assert main(["train", "train.yaml"]) == 0
    finally:
        os.chdir(here)
    return work


@pytest.fixture
def work(trained, tmp_path, monkeypatch, capsys) -> Path:
    """A copy of the trained run's folder as the working directory."""
    copy = shutil.copytree(trained, tmp_path / "w")
    monkeypatch.chdir(copy)
    capsys.readouterr()
    return copy


def finite_garbage(path: Path) -> None:
    """The tensor bytes of a safetensors file overwritten in place with random floats in [0, 1): same size and
    header, every value finite, and wrong."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # after the JSON header
    data[start:] = torch.rand((len(data) - start) // 4 + 1).numpy().tobytes()[: len(data) - start]
    path.write_bytes(bytes(data))


def one_line_error(code: int, err: str) -> str:
    """The error: exit 2, the last line of stderr (before it only `resume: KEY old -> new` notes and warnings)."""
    assert code == 2 and "Traceback" not in err, err
    *notes, line = err.strip().splitlines()
    assert re.match(r"grpo( eval| export)?: error: ", line), err
    assert all(n.startswith(("resume: ", "warning: ")) for n in notes), err
    return line


# item 11: a corrupt or incomplete newest checkpoint -------------------------------------------------------------
DAMAGES = {
    "model_garbage": (lambda c: finite_garbage(c / "model/model.safetensors"), "model/model.safetensors differs"),
    "state_garbage": (lambda c: finite_garbage(c / "trainer_state.safetensors"), "trainer_state.safetensors differs"),
    "no_trainer_state": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    "config_edited": (lambda c: (c / "config.yaml").write_text((c / "config.yaml").read_text().replace("seed: 0",
                                                                                                       "seed: 1")),
                      "config.yaml"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_newest_checkpoint_is_refused_naming_the_one_that_verifies(work, capsys, damage):
    """Finite garbage in the weights or the trainer state resumed with exit 0 (and the intact older checkpoints were
    then pruned); a newest checkpoint without trainer_state.json was skipped silently and later replaced."""
    harm, what = DAMAGES[damage]
    harm(work / STEP2)
    before = tree(work)
    err = one_line_error(*grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys))
    assert what in err and STEP2 in err and "nothing was deleted" in err
    command = f"grpo train train.yaml schedule.steps=3 --resume {STEP1}"
    assert err.rstrip().endswith(command), err
    assert tree(work) == before  # no fallback of its own, nothing deleted, nothing written
    if damage in ("model_garbage", "no_trainer_state"):  # the command it names works; the damaged one is kept aside
        assert main(shlex.split(command)[1:]) == 0
        (aside,) = work.glob("run/superseded-*/checkpoints/step-000002")
        assert tree(aside) == {k[len(STEP2) + 1:]: v for k, v in before.items() if k.startswith(STEP2 + "/")}
        assert sorted(p.name for p in (work / "run/checkpoints").iterdir()) == ["step-000002", "step-000003"]


@pytest.mark.parametrize("part,file", [("weights", "model/model.safetensors"),
                                       ("optimizer state", "trainer_state.safetensors")])
def test_nonfinite_resumed_weights_are_refused_never_called_the_last_good_checkpoint(work, capsys, part, file):
    """A checkpoint whose weights (or Adam moments: the first update makes the weights NaN) are NaN resumed and then
    stopped naming itself as "the last good checkpoint"."""
    from grpo_engine.checkpoint.verify import MANIFEST

    path = work / STEP2 / file
    save_file({k: torch.full_like(t, float("nan")) if t.is_floating_point() else t
               for k, t in load_file(path).items()}, path)
    (work / STEP2 / MANIFEST).unlink()  # written before manifests: nothing to verify it by
    err = one_line_error(*grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys))
    assert f"{STEP2}: its {part}" in err and "NaN/inf" in err and "last good" not in err
    assert err.endswith(f"--resume {STEP1}")


def test_a_checkpoint_written_before_manifests_resumes_with_one_warning(work, capsys):
    for ckpt in (STEP1, STEP2):
        (work / ckpt / "manifest.json").unlink()
    code, err = grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys)
    assert code == 0 and err.count("has no manifest.json (written before checkpoint manifests)") == 1, err
    assert (work / "run/checkpoints/step-000003/manifest.json").is_file()


def test_eval_and_export_check_the_checkpoint(work, capsys):
    finite_garbage(work / STEP2 / "model/model.safetensors")
    for argv in (["eval", "run", "--n", "1", "--max-examples", "1"], ["export", STEP2, "out.gguf"]):
        err = one_line_error(*grpo(*argv, capsys=capsys))
        assert "model/model.safetensors differs from its manifest" in err and f"{STEP1}: pass it instead" in err
    assert not (work / "out.gguf").exists()
    from grpo_engine.checkpoint.store import model_source

    assert model_source(STEP1) == Path(STEP1) / "model"


# item 10: changed task data ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [8, 2], ids=["rewritten", "fewer_than_the_position"])
def test_changed_data_is_refused_in_one_line_or_allowed_with_the_flag(work, capsys, rows):
    write_rows(work / "data.jsonl", rows, answer=lambda i: str(i + 1))
    err = one_line_error(*grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys))
    assert "data.jsonl (task.options.data_path) changed" in err and "--allow-data-change" in err
    assert f"8 -> {rows} rows" in err if rows != 8 else "same 8 rows, other content" in err
    code, err = grpo("train", "train.yaml", "schedule.steps=3", "--resume", "--allow-data-change", capsys=capsys)
    assert code == 0 and "warning: --allow-data-change: the task data changed" in err
    stored = json.loads((work / "run/checkpoints/step-000003/data.json").read_text())
    assert stored["files"]["task.options.data_path"]["rows"] == rows  # the new data is the record from now on


def test_a_checkpoint_without_a_data_record_resumes_as_before(work, capsys):
    from grpo_engine.checkpoint.verify import write_manifest

    (work / STEP2 / "data.json").unlink()
    write_manifest(work / STEP2)
    write_rows(work / "data.jsonl", 8, answer=lambda i: str(i + 1))
    assert grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys)[0] == 0


# item 9: settings compared by what they mean ---------------------------------------------------------------------
def test_settings_are_compared_by_what_they_mean(tiny_ckpt, tmp_path, monkeypatch):
    from grpo_engine.checkpoint.resume import check_resume_config
    from grpo_engine.config import ConfigError, load_config, to_yaml

    monkeypatch.chdir(Path(tiny_ckpt).parent)
    cfg = str(REPO / "configs/tiny_arithmetic.yaml")
    rel = os.path.relpath(tiny_ckpt)
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(cfg, [f"model.path={rel}", "memory.precision=auto"])))
    said = []
    same = [f"model.path={tiny_ckpt}", f"tokenizer.path={tiny_ckpt}"]
    if not torch.cuda.is_available():
        same.append("memory.precision=fp32")  # auto is fp32 on a CPU
    assert check_resume_config(tmp_path, load_config(cfg, same), said.append) == [] and said == []
    with pytest.raises(ConfigError, match="model.path: .* -> "):
        check_resume_config(tmp_path, load_config(cfg, [f"model.path={tmp_path}"]), said.append)
    # a warm start's model.path is its own RUN_DIR/sft: not compared; its settings are
    warm = ["warm_start.tiny.arch=qwen2", "warm_start.sft.steps=2", f"run_dir={tmp_path}/r"]
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(cfg, [*warm, f"model.path={tmp_path}/r/sft"])))
    assert check_resume_config(tmp_path, load_config(cfg, warm), said.append) == []
    with pytest.raises(ConfigError, match=r"warm_start.sft.steps: 2 -> 3"):
        check_resume_config(tmp_path, load_config(cfg, [*warm, "warm_start.sft.steps=3"]), said.append)
    # memory settings left to the engine: the stored config holds what it chose, and leaving them again is no change
    chosen = ["memory.micro_batch_tokens=1024", "memory.logprob_chunk_size=256", "memory.checkpoint_every=3"]
    left = [*same, "memory.micro_batch_tokens=0", "memory.logprob_chunk_size=0", "memory.activation_checkpointing=auto"]
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(cfg, [*same, *chosen])))
    assert check_resume_config(tmp_path, load_config(cfg, left), said.append) == [] and said == []
    changed = check_resume_config(tmp_path, load_config(cfg, [*left, "memory.micro_batch_tokens=2048"]), said.append)
    assert [c[0] for c in changed] == ["memory.micro_batch_tokens"] and "1024 -> 2048" in said[-1]


TINY_WARM_START = ["warm_start.tiny.hidden_size=32", "warm_start.tiny.num_hidden_layers=1",
                   "warm_start.tiny.num_attention_heads=2", "warm_start.tiny.num_key_value_heads=1",
                   "warm_start.tiny.intermediate_size=64", "warm_start.sft.steps=2", "warm_start.sft.batch_size=4",
                   "task.options.n_train=32", "task.options.n_test=4", "rollout.prompts_per_step=2",
                   "rollout.group_size=2", "schedule.steps=2", "eval.every=0", "checkpoint.every=1",
                   "logging.samples_every=0", "logging.progress=false"]


@pytest.mark.parametrize("recipe", ["grpo_engine/recipes/demo.yaml", "configs/tiny_tools.yaml"])
def test_a_warm_started_run_resumes(tmp_path, capsys, recipe):
    """The demo recipe and configs/tiny_tools.yaml stored model.path=RUN_DIR/sft; the config's is empty: --resume was
    refused after --stop-after, Ctrl-C or SIGTERM (each leaves the same checkpoint) for a change nobody made."""
    args = ["train", REPO / recipe, *TINY_WARM_START, f"run_dir={tmp_path / 'r'}"]
    assert grpo(*args, "--stop-after", "1", capsys=capsys)[0] == 0
    code, err = grpo(*args, "--resume", capsys=capsys)
    assert code == 0 and "model.path" not in err, err
    assert [json.loads(ln)["step"] for ln in (tmp_path / "r/metrics.jsonl").read_text().splitlines()] == [1, 2]
