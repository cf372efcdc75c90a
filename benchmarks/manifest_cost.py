"""What checking a checkpoint against its manifest adds to loading it (checkpoint/verify.py).

    python benchmarks/manifest_cost.py                                    # SmolLM2-135M's shape, fp32
    python benchmarks/manifest_cost.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 \
        --intermediate 4864 --vocab 151936 --repeats 3                    # Qwen2.5-0.5B's shape
    python benchmarks/manifest_cost.py --json

Writes one checkpoint of a model of the given shape with random weights (model/ and, for a resume, the AdamW
state of a full fine-tune: trainer_state.safetensors, twice the weights) through the engine's own
save_checkpoint, then times, interleaved:

- eval: model_source (what `grpo eval` / `grpo export` check: model/, config.yaml) + load_model (memory-mapped);
- resume: resolve_resume (every file) + load_trainer_state + load_model;
- export: the whole of `grpo export CKPT OUT.gguf` (f16): the check, reading the weights, writing them out;
- train --resume: the whole set-up of `grpo train CONFIG --resume` (setup_run: checks, optimizer state, model,
  tokenizer, task data) on a run of one step of configs/tiny_arithmetic.yaml with the same model (--no-train: not);

each in three ways (export and train --resume: the last two): `load only` (no check: the reference), `stamped` (a
checkpoint this machine wrote or already checked: its files' stats) and `copied` (a checkpoint from elsewhere: a
fresh stamp cache for each repeat, so every file read is hashed in full before it is used). The files are in the
page cache (read once before timing): where hashing costs the most next to loading. The weights are
memory-mapped, so `load only` of eval and resume is mostly the mapping; the whole commands show the cost a user
waits for.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from grpo_engine.checkpoint import stamps  # noqa: E402
from grpo_engine.checkpoint.store import (  # noqa: E402
    TrainerState,
    capture_rng,
    load_trainer_state,
    model_source,
    resolve_resume,
    save_checkpoint,
)
from grpo_engine.checkpoint.verify import check  # noqa: E402
from grpo_engine.config import load_config  # noqa: E402
from grpo_engine.gguf_export import export_gguf  # noqa: E402
from grpo_engine.kernels import cpu_model  # noqa: E402
from grpo_engine.kernels.select import cache_path  # noqa: E402
from grpo_engine.model.loading import load_model, save_model  # noqa: E402
from grpo_engine.model.tiny import tiny_config, write_byte_tokenizer  # noqa: E402
from grpo_engine.model.transformer import Transformer  # noqa: E402
from grpo_engine.train.loop import train  # noqa: E402
from grpo_engine.train.setup import setup_run  # noqa: E402


def model_config(args):
    return tiny_config("qwen2-tied", vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)


def write_checkpoint(root: Path, args) -> Path:
    """step-000001 under root/checkpoints: random weights and a full fine-tune's AdamW state."""
    model = Transformer(model_config(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # fills exp_avg / exp_avg_sq
    state = TrainerState(step=1, data_position=0, optimizer=opt.state_dict(), scheduler={}, rng=capture_rng())
    write_byte_tokenizer(root / "tokenizer")
    return save_checkpoint(root / "checkpoints", model, state, config_yaml="seed: 0\n", metrics_path=None,
                           tokenizer_dir=root / "tokenizer", keep_last=2)


def write_run(root: Path, args) -> Path:
    """The step-000001 of one step of configs/tiny_arithmetic.yaml (root/train.yaml) on a random model."""
    write_byte_tokenizer(root / "tokenizer")
    save_model(Transformer(model_config(args)), root / "base", tokenizer_dir=root / "tokenizer")
    config = yaml.safe_load((REPO / "configs" / "tiny_arithmetic.yaml").read_text())
    config.update(run_dir=str(root / "run"))
    config["model"]["path"], config["schedule"]["steps"] = str(root / "base"), 1
    (root / "train.yaml").write_text(yaml.safe_dump(config))
    train(load_config(str(root / "train.yaml")))
    return root / "run" / "checkpoints" / "step-000001"


def use_cache(root: Path, plan_from: Path | None) -> None:
    """GRPO_CACHE_DIR=root (a stamp cache of its own) with plan_from's kernel plan, so that no plan is measured."""
    os.environ["GRPO_CACHE_DIR"] = str(root)
    if plan_from is not None and plan_from.is_file():
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(plan_from, cache_path())


def fresh_stamps() -> None:
    """As if the checkpoint were copied here: no stamp of this machine's for it (the kernel plan is kept)."""
    root = tempfile.mkdtemp(prefix="stamps-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    use_cache(Path(root), cache_path())


def eval_load(ckpt: Path, way: str) -> None:
    load_model(ckpt / "model" if way == "load only" else model_source(ckpt))


def export(ckpt: Path, way: str) -> None:
    export_gguf(str(ckpt), str(ckpt.parent.parent / "out.gguf"), "f16", overwrite=True)


def resume_load(ckpt: Path, way: str) -> None:
    if way != "load only":
        resolve_resume(str(ckpt), ckpt.parent, command="bench")
    load_trainer_state(ckpt)
    load_model(ckpt / "model")


def train_resume(ckpt: Path, way: str) -> None:
    """The whole set-up of `grpo train CONFIG --resume` (model, tokenizer, optimizer state, task data, checks)."""
    run = setup_run(load_config(str(ckpt.parents[2] / "train.yaml")), resume=str(ckpt))
    run.monitor.close()
    run.lock.release()


WAYS = ("load only", "stamped", "copied")


def measure(ckpt: Path, run_ckpt: Path | None, repeats: int) -> dict:
    """Median seconds per load and way; run_ckpt: write_run's checkpoint to resume whole, or None to skip that."""
    kinds = {"eval": (eval_load, ckpt, WAYS), "resume": (resume_load, ckpt, WAYS), "export": (export, ckpt, WAYS[1:])}
    if run_ckpt is not None:
        kinds["train --resume"] = (train_resume, run_ckpt, WAYS[1:])
    times = {kind: {way: [] for way in ways} for kind, (_, _, ways) in kinds.items()}
    for kind, (load, target, ways) in kinds.items():
        fresh_stamps()
        time.sleep(max(0.0, 2 * stamps.RACY_NS / 1e9))  # files stamped within RACY_NS of being written are hashed again
        check(target)  # stamps every file and reads it into the page cache
        load(target, ways[0])
        stamped_cache = os.environ["GRPO_CACHE_DIR"]
        for _ in range(repeats):
            for way in ways:
                if way == "copied":
                    fresh_stamps()
                else:
                    os.environ["GRPO_CACHE_DIR"] = stamped_cache
                t0 = time.perf_counter()
                load(target, way)
                times[kind][way].append(time.perf_counter() - t0)
    return {kind: {way: statistics.median(ts) for way, ts in ways.items()} for kind, ways in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-train", action="store_true", help="skip the whole `grpo train --resume` set-up")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="manifest-cost-") as tmp:
        use_cache(Path(tmp) / "cache", cache_path())  # stamps of its own; the user's kernel plan, not measured again
        ckpt = write_checkpoint(Path(tmp), args)
        run_ckpt = None if args.no_train else write_run(Path(tmp) / "train", args)
        sizes = {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in ckpt.rglob("*.safetensors")}
        result = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__, "bytes": sizes,
                  "seconds": measure(ckpt, run_ckpt, args.repeats)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['cpu']}, {os.cpu_count()} cores, torch {torch.__version__}; files: "
          + ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in sizes.items()))
    for kind, ways in result["seconds"].items():
        base = next(iter(ways.values()))
        print(f"{kind}: " + "; ".join(f"{way} {s:.2f} s ({(s - base) / base:+.0%})" for way, s in ways.items()))


if __name__ == "__main__":
    main()
