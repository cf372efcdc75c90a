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

each in four ways (export: the last three): `load only` (no check: the reference), `stamped` (a checkpoint this
machine wrote or already checked: its files' stats), `copied, hashed first` (a checkpoint from elsewhere, every
file hashed before it is loaded) and `copied, hashed while loading` (what the engine does: files over SOON_BYTES
hashed on background threads while they load, the caller joining in before use). "Copied" is a fresh stamp cache
for each repeat. The files are in the page cache (read once before timing): where hashing costs the most.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

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
from grpo_engine.checkpoint.verify import MODEL_PARTS, check, settle  # noqa: E402
from grpo_engine.gguf_export import export_gguf  # noqa: E402
from grpo_engine.model.loading import load_model  # noqa: E402
from grpo_engine.model.tiny import tiny_config, write_byte_tokenizer  # noqa: E402
from grpo_engine.model.transformer import Transformer  # noqa: E402


def write_checkpoint(root: Path, args) -> Path:
    """step-000001 under root/checkpoints: random weights and a full fine-tune's AdamW state."""
    cfg = tiny_config("qwen2-tied", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # fills exp_avg / exp_avg_sq
    state = TrainerState(step=1, data_position=0, optimizer=opt.state_dict(), scheduler={}, rng=capture_rng())
    write_byte_tokenizer(root / "tokenizer")
    return save_checkpoint(root / "checkpoints", model, state, config_yaml="seed: 0\n", metrics_path=None,
                           tokenizer_dir=root / "tokenizer", keep_last=2)


def fresh_stamps() -> None:
    """As if the checkpoint were copied here: no stamp of this machine's for it."""
    os.environ["GRPO_CACHE_DIR"] = tempfile.mkdtemp(prefix="stamps-")
    stamps._memory.clear()


def eval_load(ckpt: Path, way: str) -> None:
    if way == "copied, hashed first":
        assert check(ckpt, MODEL_PARTS).ok
        load_model(ckpt / "model")
    elif way == "load only":
        load_model(ckpt / "model")
    else:
        load_model(model_source(ckpt))
        settle()


def export(ckpt: Path, way: str) -> None:
    if way == "copied, hashed first":
        assert check(ckpt, MODEL_PARTS).ok
    export_gguf(str(ckpt), str(ckpt.parent.parent / "out.gguf"), "f16", overwrite=True)


def resume_load(ckpt: Path, way: str) -> None:
    if way == "copied, hashed first":
        assert check(ckpt).ok
    elif way != "load only":
        resolve_resume(str(ckpt), ckpt.parent, command="bench")
    load_trainer_state(ckpt)
    load_model(ckpt / "model")
    settle()


WAYS = ("load only", "stamped", "copied, hashed first", "copied, hashed while loading")


def measure(ckpt: Path, repeats: int) -> dict:
    kinds = {"eval": (eval_load, WAYS), "resume": (resume_load, WAYS), "export": (export, WAYS[1:])}
    times = {kind: {way: [] for way in ways} for kind, (_, ways) in kinds.items()}
    for kind, (load, ways) in kinds.items():
        fresh_stamps()
        time.sleep(max(0.0, 2 * stamps.RACY_NS / 1e9))  # files stamped within RACY_NS of being written are hashed again
        check(ckpt)  # stamps every file and reads it into the page cache
        load(ckpt, ways[0])
        stamped_cache = os.environ["GRPO_CACHE_DIR"]
        for _ in range(repeats):
            for way in ways:
                if way.startswith("copied"):
                    fresh_stamps()
                else:
                    os.environ["GRPO_CACHE_DIR"] = stamped_cache
                t0 = time.perf_counter()
                load(ckpt, way)
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="manifest-cost-") as tmp:
        ckpt = write_checkpoint(Path(tmp), args)
        sizes = {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in ckpt.rglob("*.safetensors")}
        result = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                  "torch": torch.__version__, "bytes": sizes, "seconds": measure(ckpt, args.repeats)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{os.cpu_count()} cores, torch {torch.__version__}; files: "
          + ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in sizes.items()))
    for kind, ways in result["seconds"].items():
        base = next(iter(ways.values()))
        print(f"{kind}: " + "; ".join(f"{way} {s:.2f} s ({(s - base) / base:+.0%})" for way, s in ways.items()))


if __name__ == "__main__":
    main()
