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


def before_manifests(ckpt: Path) -> None:
    """ckpt as a checkpoint written before manifests: no manifest.json, and no data.json or resolved.yaml (written
    only alongside one)."""
    (ckpt / "manifest.json").unlink()
    (ckpt / "data.json").unlink()
    (ckpt / "resolved.yaml").unlink()


def one_line_error(code: int, err: str) -> str:
    """The error: exit 2, the last line of stderr (before it only `resume: KEY old -> new` notes and warnings)."""
    assert code == 2 and "Traceback" not in err, err
    *notes, line = err.strip().splitlines()
    assert re.match(r"grpo( eval| export| generate)?: error: ", line), err
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
    path = work / STEP2 / file
    save_file({k: torch.full_like(t, float("nan")) if t.is_floating_point() else t
               for k, t in load_file(path).items()}, path)
    before_manifests(work / STEP2)  # nothing to verify it by
    err = one_line_error(*grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys))
    assert f"{STEP2}: its {part}" in err and "NaN/inf" in err and "last good" not in err
    assert err.endswith(f"--resume {STEP1}")


def test_a_checkpoint_written_before_manifests_resumes_with_one_warning(work, capsys):
    for ckpt in (STEP1, STEP2):
        before_manifests(work / ckpt)
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
                   "logging.samples_every=0", "logging.progress=false", "check.stop=false"]  # a 2-step SFT: no signal


@pytest.mark.parametrize("recipe", ["grpo_engine/recipes/demo.yaml", "configs/tiny_tools.yaml"])
def test_a_warm_started_run_resumes(tmp_path, capsys, recipe):
    """The demo recipe and configs/tiny_tools.yaml stored model.path=RUN_DIR/sft; the config's is empty: --resume was
    refused after --stop-after, Ctrl-C or SIGTERM (each leaves the same checkpoint) for a change nobody made."""
    args = ["train", REPO / recipe, *TINY_WARM_START, f"run_dir={tmp_path / 'r'}"]
    assert grpo(*args, "--stop-after", "1", capsys=capsys)[0] == 0
    code, err = grpo(*args, "--resume", capsys=capsys)
    assert code == 0 and "model.path" not in err, err
    assert [json.loads(ln)["step"] for ln in (tmp_path / "r/metrics.jsonl").read_text().splitlines()] == [1, 2]


# issue 51: what a run directory may not do to you ---------------------------------------------------------------
def record_here(work: Path, ckpt: str = STEP2) -> Path:
    """The copy's data record pointed at the copy's own data.jsonl (the fixture's records the original folder), its
    manifest rewritten to match: a run trained here."""
    from grpo_engine.checkpoint.verify import write_manifest

    record = json.loads((work / ckpt / "data.json").read_text())
    (root,) = record["roots"].values()  # the absolute path of the folder the run was trained in
    assert list(record["roots"]) == ["task.options.data_path"] and Path(root).is_absolute() and root != str(work)
    record["roots"]["task.options.data_path"] = str(work / "data.jsonl")
    (work / ckpt / "data.json").write_text(json.dumps(record))
    write_manifest(work / ckpt)
    return work / "data.jsonl"


def evaluated(err: str) -> str:
    """The `evaluating MODEL on TASK/SPLIT: N problems` line of grpo eval."""
    return next(line for line in err.splitlines() if line.startswith("evaluating "))


def test_case8_eval_reads_the_run_data_where_the_run_recorded_it_never_another_folders(work, capsys, tmp_path):
    """`grpo eval RUN_DIR` read the stored relative data_path against the current directory: another folder's
    data.jsonl with 3 rows was evaluated instead of the run's 8, and the fingerprint was never compared."""
    data = record_here(work)
    record = json.loads((work / STEP2 / "data.json").read_text())
    assert record["files"]["task.options.data_path"]["path"] == "data.jsonl"  # as the config names it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_rows(elsewhere / "data.jsonl", 3)
    os.chdir(elsewhere)
    code, err = grpo("eval", work / "run", "--n", "1", "--temperature", "0", capsys=capsys)
    assert code == 0, err
    code, mine = grpo("eval", work / "run", "--n", "1", "--temperature", "0", "--data", data, capsys=capsys)
    assert code == 0 and evaluated(err) == evaluated(mine)  # the run's 8 rows, as if named with --data
    write_rows(data, 8, answer=lambda i: str(i + 1))  # the run's data changed where it was recorded
    err = one_line_error(*grpo("eval", work / "run", "--n", "1", capsys=capsys))
    assert f"{data} (task.options.data_path) changed: same 8 rows, other content" in err
    assert err.endswith("pass --data FILE to evaluate on data you choose")
    data.unlink()
    assert f"{data} (task.options.data_path) is not there any more" in one_line_error(
        *grpo("eval", work / "run", "--n", "1", capsys=capsys))


@pytest.mark.parametrize("case", ["case1_dev_zero", "case2_fifo"])
def test_a_stored_data_path_to_a_device_or_fifo_is_refused_at_once(work, capsys, case):
    """A handed-over run's data path linked to /dev/zero took 5.6 GB in 17 s under `grpo eval`; a FIFO hung it."""
    from tasks.test_untrusted_data import returns_within

    data = record_here(work)
    data.unlink()
    data.symlink_to("/dev/zero") if case == "case1_dev_zero" else os.mkfifo(data)
    done, code = returns_within(30, lambda: main(["eval", "run", "--n", "1"]))
    assert done and code == 2
    err = one_line_error(code, capsys.readouterr().err)
    kind = "(-> /dev/zero) is a character device" if case == "case1_dev_zero" else "is a FIFO (named pipe)"
    assert f"the run's data cannot be read (task.options.data_path='{data}' {kind}" in err and "--data" in err


def test_eval_of_a_run_without_data_record_refuses_a_relative_stored_path(work, capsys):
    from grpo_engine.checkpoint.verify import write_manifest

    (work / STEP2 / "data.json").unlink()
    write_manifest(work / STEP2)
    err = one_line_error(*grpo("eval", "run", "--n", "1", capsys=capsys))
    assert "names task.options.data_path='data.jsonl', a relative path, and it has no data.json" in err
    assert grpo("eval", "run", "--n", "1", "--temperature", "0", "--data", "data.jsonl", capsys=capsys)[0] == 0


def added_shard(ckpt: Path) -> None:
    """Every tensor mapped by an added model.safetensors.index.json to an added shard of other weights."""
    from safetensors.torch import load_file

    tensors = load_file(ckpt / "model/model.safetensors")
    save_file({k: t + 1 for k, t in tensors.items()}, ckpt / "model/model-00001-of-00001.safetensors")
    (ckpt / "model/model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}))


def test_case4_and_case5_an_added_shard_index_is_refused_by_export_and_resume(work, capsys):
    """An index.json beside a checkpoint's weights, not in its manifest, mapping them to an added file: export
    exported the added weights and --resume trained from them (and the next manifest vouched for them)."""
    added_shard(work / STEP2)
    err = one_line_error(*grpo("export", STEP2, "out.gguf", capsys=capsys))
    assert (f"{STEP2}: model/model-00001-of-00001.safetensors (and 1 more) is not in its manifest.json" in err
            and f"{STEP1}: pass it instead" in err)
    assert not (work / "out.gguf").exists()
    err = one_line_error(*grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys))
    assert "is not in its manifest.json" in err and err.endswith(f"--resume {STEP1}")
    assert not (work / "run/checkpoints/step-000003").exists()


def test_case6_an_added_chat_template_is_refused_by_generate(work, capsys):
    (work / STEP2 / "model/chat_template.jinja").write_text("{{ 'forged: ' + messages[0]['content'] }}")
    err = one_line_error(*grpo("generate", "run", "what is 2+2?", "--max-new", "2", capsys=capsys))
    assert f"{STEP2}: model/chat_template.jinja is not in its manifest.json" in err


def test_case7_manifest_era_files_without_a_manifest_are_damage_not_legacy(work, capsys):
    """Deleting manifest.json from a checkpoint with data.json made it "written before manifests": a flipped bit in
    its weights was trained on."""
    (work / STEP2 / "manifest.json").unlink()
    finite_garbage(work / STEP2 / "model/model.safetensors")
    before = tree(work)
    err = one_line_error(*grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys))
    assert f"{STEP2}: it has data.json, which is written only alongside a manifest.json, but no manifest.json" in err
    assert err.endswith(f"--resume {STEP1}") and tree(work) == before
    assert "it has data.json" in one_line_error(*grpo("eval", "run", "--n", "1", capsys=capsys))


@pytest.mark.parametrize("config", ["case9_missing", "case10_fifo", "case10_link_to_dev_null"])
def test_case9_and_case10_a_legacy_checkpoint_needs_a_regular_config(work, capsys, config):
    """A checkpoint without manifest whose config.yaml was missing (or a FIFO, or a link to a device) was evaluated
    with the task's default options: 200 default problems instead of the run's."""
    before_manifests(work / STEP2)
    stored = work / STEP2 / "config.yaml"
    stored.unlink()
    if config == "case10_fifo":
        os.mkfifo(stored)
    elif config == "case10_link_to_dev_null":
        stored.symlink_to("/dev/null")
    err = one_line_error(*grpo("eval", "run", "--n", "1", capsys=capsys))
    what = "is missing" if config == "case9_missing" else "is not a regular file"
    assert f"{STEP2}: it has no manifest.json (written before manifests) and its config.yaml {what}" in err
    assert f"{STEP1}: pass it instead" in err


def test_case14_a_lone_surrogate_is_one_line_in_train_eval_and_generate(work, capsys):
    (work / "bad.jsonl").write_text('{"prompt": "q", "answer": "1"}\n{"prompt": "x\\ud800", "answer": "1"}\n')
    want = "bad.jsonl: line 2: field 'prompt' holds a lone surrogate (\\ud800), which is not text"
    assert want in one_line_error(*grpo("eval", "run", "--data", "bad.jsonl", "--n", "1", capsys=capsys))
    assert want in one_line_error(*grpo("train", "train.yaml", "run_dir=other", "task.options.data_path=bad.jsonl",
                                        capsys=capsys))
    err = one_line_error(*grpo("generate", "run", "caf\udce9", capsys=capsys))  # how Python passes latin-1 argv
    assert "the question holds a lone surrogate (\\udce9) at character 3" in err


# issue 52: what the machine decided, stored as resolved.yaml -----------------------------------------------------
def test_a_checkpoint_lists_resolved_yaml_as_grpo_config_show_resolved_prints_it(work, capsys):
    """resolved.yaml is in the manifest, holds what `grpo config show CONFIG --resolved` says this machine decides
    (the CPU's device and precision, the memory settings), and its config is the one config.yaml holds."""
    from grpo_engine.config import config_from_yaml_text

    ckpt = work / STEP2
    assert "resolved.yaml" in json.loads((ckpt / "manifest.json").read_text())["files"]
    assert main(["config", "show", "train.yaml", "--resolved"]) == 0
    shown = capsys.readouterr().out
    assert (ckpt / "resolved.yaml").read_text() == shown
    machine = yaml.safe_load(shown)["machine"]
    assert machine == {"device": "cpu", "precision": "fp32", "precision_why": "set in the config", "card_gib": None,
                       "planned_gib": None}
    stored = config_from_yaml_text(shown)
    assert stored == config_from_yaml_text((ckpt / "config.yaml").read_text())
    assert stored.memory.logprob_chunk_size == 256  # tiny_arithmetic.yaml leaves it to the engine: the CPU default


def test_resume_and_eval_read_resolved_yaml_first_and_older_checkpoints_resume_bit_for_bit(work, tmp_path, capsys):
    from grpo_engine.checkpoint.verify import write_manifest
    from grpo_engine.eval.cli import stored_run_config

    old = shutil.copytree(work, tmp_path / "old")
    (old / STEP2 / "resolved.yaml").unlink()  # a checkpoint written before resolved.yaml
    write_manifest(old / STEP2)
    assert stored_run_config(str(old / STEP2)).seed == stored_run_config(str(work / STEP2)).seed == 0
    assert grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys)[0] == 0
    os.chdir(old)
    assert grpo("train", "train.yaml", "schedule.steps=3", "--resume", capsys=capsys)[0] == 0
    step3 = "run/checkpoints/step-000003/model/model.safetensors"
    assert (old / step3).read_bytes() == (work / step3).read_bytes()
    resolved = work / STEP2 / "resolved.yaml"  # resolved.yaml, not config.yaml, is what they read
    resolved.write_text(resolved.read_text().replace("\n  seed: 0\n", "\n  seed: 7\n"))
    write_manifest(work / STEP2)
    assert stored_run_config(str(work / STEP2)).seed == 7
    os.chdir(work)
    err = one_line_error(*grpo("train", "train.yaml", "schedule.steps=4", "--resume", STEP2, capsys=capsys))
    assert "seed: 7 -> 0" in err
