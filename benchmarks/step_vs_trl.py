"""Seconds per GRPO step and peak RSS: grpo-engine vs TRL's GRPOTrainer, same work, on CPU, in one run.

    python benchmarks/step_vs_trl.py                       # ~100M-param Qwen2 shape, 151,936 vocab (minutes)
    python benchmarks/step_vs_trl.py --hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 128 \
        --vocab 272 --steps 3                              # dry run in seconds
    python benchmarks/step_vs_trl.py --engines ours,trl,trl-bf16   # TRL in fp32 and with bf16=True, one run
    python benchmarks/step_vs_trl.py --engines ours,ours-fp32,trl   # ours at its defaults and pinned to fp32

Both engines get the same checkpoint (written here with make_tiny_checkpoint, or --model DIR), P prompts of the
same length, G samples each, exactly --max-new completion tokens (EOS cannot end a completion: ours never stops on
it, TRL has the EOS/pad ids suppressed), TRL in fp32 and ours at its defaults (memory.precision=auto: bf16 on a CPU
where it measures faster, grpo_engine/plan/precision.py; the engine `ours-fp32` pins fp32, `ours-bf16` bf16),
beta = 0 (no reference model), one update per step (mu = 1), torch's fused AdamW (transformers' default optim) with the
same learning rate, and the same kind of reward (a seeded pseudo-random number per completion: it varies within
each group, so every advantage is non-zero and neither engine can skip a row of the update). The engine `trl-bf16`
is TRL with GRPOConfig(bf16=True): Trainer's mixed precision (bf16 autocast over the fp32 weights and optimizer
state), the setting TRL users pick on a CPU with bf16 products; its time and RSS ratios are reported beside fp32
TRL's.

Each engine runs in its own child process so its peak RSS (ru_maxrss of the child) is its own:
  * ours: `python -m grpo_engine.cli bench step ... --json` (grpo_engine/bench/step.py: the trainer's phases);
  * TRL: this file with --child trl (GRPOTrainer; a TrainerCallback times on_step_begin -> on_step_end,
    which covers generation, reward, loss, backward and the optimizer step), with --trl-bf16 for trl-bf16.
All children are alive at once but take turns (grpo_engine/bench/turns.py): each one's set-up runs alone, then
our step 1, TRL's step 1, our step 2, TRL's step 2, ... A machine whose speed drifts over minutes then gives each
pair of steps the same speed, and the time ratio is the median of the pairs' ratios after the first pair (the
first steps pay one-off warm-up). Each engine's own figure is its median step after the first.
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "RESULT_JSON "  # the child's result line; TRL prints other things on stdout too
LR = 1e-6  # the learning rate grpo_engine/bench_step.py uses; TRL is given the same


SMALL = {"hidden": 512, "vocab": 151_936}  # the default shape's widths (SMALL), which set its targets


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="existing HF checkpoint dir (default: write a random one of the shape below)")
    p.add_argument("--arch", default="qwen2", help="make_tiny_checkpoint arch: qwen2 (untied, ~178M params at "
                   "the default shape), qwen2-tied (~100M), qwen3, llama3")
    p.add_argument("--hidden", type=int, default=SMALL["hidden"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=SMALL["vocab"])
    p.add_argument("--prompts", type=int, default=4, help="P prompts per step")
    p.add_argument("--group", type=int, default=8, help="G completions per prompt")
    p.add_argument("--max-new", type=int, default=64, help="completion length (fixed)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--steps", type=int, default=4, help="steps per engine; the median excludes the first")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="our log-prob chunk (memory.logprob_chunk_size; default: the engine's default)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="our memory.micro_batch_tokens: padded tokens per forward/backward (default: the engine's)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0 = torch default)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="turn on TRL's gradient checkpointing (GRPOConfig's default); off = same as ours")
    p.add_argument("--engines", default="ours,trl", help="comma list: ours, trl (fp32), trl-bf16 (TRL with "
                   "bf16=True: bf16 autocast over fp32 weights)")
    p.add_argument("--child", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--trl-bf16", action="store_true", help=argparse.SUPPRESS)  # the trl-bf16 child
    p.add_argument("--turn-fds", help=argparse.SUPPRESS)  # the child's turn pipe (grpo_engine/bench/turns.py)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ checkpoint
def make_checkpoint(args, out_dir: Path) -> Path:
    from grpo_engine.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(out_dir, args.arch, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                intermediate_size=args.intermediate, vocab_size=args.vocab,
                                max_position_embeddings=max(2048, args.prompt_len + args.max_new))


# ------------------------------------------------------------------------------------------ children
def child_env() -> dict:
    """The children import grpo_engine from this checkout even without `pip install -e .`."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class Child:
    """One engine's process, started with a turn pipe (grpo_engine/bench/turns.py): it runs a step only when given
    the turn, so the two engines' steps alternate and every pair of steps sees the machine at the same speed."""

    def __init__(self, name: str, cmd: list[str], logs: Path):
        go_read, self.go_write = os.pipe()
        self.ready_read, ready_write = os.pipe()
        self.name, self.cmd, self.t0 = name, cmd, time.perf_counter()
        self.out_path, self.err_path = logs / f"{name}.out", logs / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:  # the child writes its own copies
            self.proc = subprocess.Popen([*cmd, "--turn-fds", f"{go_read},{ready_write}"], stdout=out, stderr=err,
                                         env=child_env(), cwd=REPO, pass_fds=(go_read, ready_write))
        os.close(go_read)
        os.close(ready_write)
        self.finished = False

    def wait_turn_over(self) -> None:
        """Block until the child is ready for its next step, or has exited (end of file: done or failed)."""
        if not os.read(self.ready_read, 1):
            self.finished = True

    def give_turn(self) -> None:
        os.write(self.go_write, b"G")

    def result(self) -> dict:
        """Its result: the last stdout line starting with RESULT_TAG (or a JSON object)."""
        code = self.proc.wait()
        for fd in (self.go_write, self.ready_read):
            os.close(fd)
        out, err = self.out_path.read_text(), self.err_path.read_text()
        if code != 0:
            sys.stderr.write(out[-4000:] + err[-8000:])
            raise RuntimeError(f"{self.name} child failed (exit {code}): {' '.join(self.cmd)}")
        for line in reversed(out.splitlines()):
            if line.startswith(RESULT_TAG):
                line = line[len(RESULT_TAG):]
            if line.startswith("{"):
                result = json.loads(line)
                result["child_wall_s"] = time.perf_counter() - self.t0
                return result
        sys.stderr.write(out[-4000:] + err[-4000:])
        raise RuntimeError(f"{self.name} child printed no JSON result")


def run_interleaved(commands: dict[str, list[str]], logs: Path) -> dict[str, dict]:
    """Run the engines' children so that only one of them works at a time: each one's set-up alone (its
    kernel measurements see an idle machine), then step 1 of each in turn, step 2 of each, and so on."""
    children = {}
    for name, cmd in commands.items():
        print(f"starting {name} ...", file=sys.stderr, flush=True)
        child = children[name] = Child(name, cmd, logs)
        child.wait_turn_over()  # its set-up is done: it waits for step 1 (or it has exited)
        if child.finished:  # exited before its first step: a failure raises here, before the next set-up starts
            child.result()
    while not all(c.finished for c in children.values()):
        for child in children.values():
            if not child.finished:
                child.give_turn()
                child.wait_turn_over()  # its step is over (or its last step and its exit)
    return {name: child.result() for name, child in children.items()}


def ours_command(args, model_dir: Path, precision: str | None = None) -> list[str]:
    """Our child's command line: `grpo bench step` with the engine's defaults (memory.precision=auto: bf16 on a CPU
    where it pays), or `precision` pinned (the engines ours-fp32 and ours-bf16)."""
    return [sys.executable, "-m", "grpo_engine.cli", "bench", "step", "--model", str(model_dir),
            "--prompts", str(args.prompts), "--group", str(args.group), "--max-new", str(args.max_new),
            "--prompt-len", str(args.prompt_len), "--steps", str(args.steps), "--threads", str(args.threads),
            *([] if args.chunk_size is None else ["--chunk-size", str(args.chunk_size)]),
            *([] if args.micro_batch_tokens is None else ["--micro-batch-tokens", str(args.micro_batch_tokens)]),
            "--json", "model.device=cpu",  # a CPU comparison: TRL runs with use_cpu=True, ours must not pick a GPU
            *([f"memory.precision={precision}"] if precision else [])]


def trl_command(args, model_dir: Path, bf16: bool = False) -> list[str]:
    """The TRL child's command line; bf16: GRPOConfig(bf16=True) (the engine trl-bf16)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "trl", "--model", str(model_dir),
           "--prompts", str(args.prompts), "--group", str(args.group), "--max-new", str(args.max_new),
           "--prompt-len", str(args.prompt_len), "--steps", str(args.steps), "--threads", str(args.threads)]
    if args.trl_gradient_checkpointing:
        cmd.append("--trl-gradient-checkpointing")
    if bf16:
        cmd.append("--trl-bf16")
    return cmd


ENGINE_COMMANDS = {"ours": ours_command, "ours-fp32": lambda args, model_dir: ours_command(args, model_dir, "fp32"),
                   "ours-bf16": lambda args, model_dir: ours_command(args, model_dir, "bf16"),
                   "trl": trl_command, "trl-bf16": lambda args, model_dir: trl_command(args, model_dir, bf16=True)}


# ------------------------------------------------------------------------------------------ TRL child
def templated_prompts(tok, n: int, length: int, seed: int = 0) -> list[str]:
    """n chat-templated prompt strings of exactly `length` tokens (byte-level tokenizer: filler bytes)."""
    import random

    rng = random.Random(seed)
    empty = tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True)
    fill = length - len(tok(empty, add_special_tokens=False)["input_ids"])
    if fill < 1:
        raise ValueError(f"--prompt-len {length} is shorter than the chat template itself; raise it")
    out = []
    for _ in range(n):
        text = "".join(rng.choice("0123456789+*=abcdefghij") for _ in range(fill))
        s = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        got = len(tok(s, add_special_tokens=False)["input_ids"])
        if got != length:
            raise ValueError(f"prompt has {got} tokens, expected {length}: this tokenizer is not byte-level; "
                             f"use a checkpoint written by make_tiny_checkpoint")
        out.append(s)
    return out


def trl_child(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_engine.bench.turns import StepTurns

    turns = StepTurns.parse(args.turn_fds) if args.turn_fds else None
    if args.threads:
        from grpo_engine.kernels.threads import fix_threads  # the engine's plan keeps this count

        fix_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = templated_prompts(tok, args.prompts * args.steps, args.prompt_len)
    lengths: list[int] = []

    rng = random.Random(0)

    def random_reward(completion_ids, **_) -> list[float]:
        """The reward of bench_step: a seeded pseudo-random number per completion (varies within a group)."""
        lengths.extend(len(c) for c in completion_ids)
        return [rng.random() for _ in completion_ids]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            if turns is not None:
                turns.wait()  # our step runs first; this one starts when the driver says so
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t0)

    never = sorted({*_eos_ids(args.model, tok), tok.pad_token_id} - {None})
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(**trl_config_kwargs(args, out_dir, never))
        timer = StepTimer()
        trainer = GRPOTrainer(model=args.model, reward_funcs=random_reward, args=config,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                              callbacks=[timer])
        trainer.train()
    tail = timer.times[1:] or timer.times
    return {
        "engine": "trl-bf16" if args.trl_bf16 else "trl", "bf16": bool(config.bf16),
        "precision": "bf16 autocast, fp32 weights" if config.bf16 else "fp32",
        "sec_per_step": statistics.median(tail), "step_times": timer.times,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "mean_completion_len": statistics.mean(lengths), "min_completion_len": min(lengths),
        "params": sum(p.numel() for p in trainer.model.parameters()), "threads": torch.get_num_threads(),
        "suppressed_token_ids": never, "gradient_checkpointing": args.trl_gradient_checkpointing,
        "optimizer": str(config.optim),
    }


def trl_config_kwargs(args, out_dir: str, never: list[int]) -> dict:
    """GRPOConfig's arguments: the same work as ours; with --trl-bf16, bf16=True (Trainer's bf16 autocast on the
    CPU), the weights still loaded in fp32 as the master copy the optimizer updates."""
    return dict(
        output_dir=out_dir, use_cpu=True, bf16=bool(args.trl_bf16), fp16=False, seed=0,
        per_device_train_batch_size=args.prompts * args.group,  # TRL counts completions
        num_generations=args.group, max_completion_length=args.max_new, gradient_accumulation_steps=1,
        num_iterations=1, beta=0.0, learning_rate=LR, temperature=1.0, max_steps=args.steps,
        gradient_checkpointing=args.trl_gradient_checkpointing, model_init_kwargs={"dtype": "float32"},
        generation_kwargs={"suppress_tokens": never},  # EOS/pad never sampled: every completion is max_new
        save_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )


def _eos_ids(model_dir: str, tok) -> list[int]:
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return [*eos, tok.eos_token_id]


# ------------------------------------------------------------------------------------------ report
def paired_ratios(ours: list[float], peer: list[float]) -> list[float]:
    """ours[i] / peer[i] for each step i both ran: step i of each ran back to back (run_interleaved)."""
    return [a / b for a, b in zip(ours, peer)]


def peer_ratios(ours: dict, peer: dict) -> dict:
    """Ours against one TRL child: the time ratio is the median of the step pairs after the first (the steps ran
    in turn, pair by pair), with the medians' and the fastest steps' ratios (a load-robust second opinion when the
    machine is shared) beside it, and the peak RSS ratio."""
    pairs = paired_ratios(ours["step_times"], peer["step_times"])
    return {"pair_time_ratios": pairs, "time_ratio": statistics.median(pairs[1:] or pairs),
            "median_time_ratio": ours["sec_per_step"] / peer["sec_per_step"],
            "rss_ratio": ours["peak_rss_mib"] / peer["peak_rss_mib"],
            "min_time_ratio": min(ours["step_times"]) / min(peer["step_times"])}


SMALL_TARGETS = {"time_ratio": 0.25, "rss_ratio": 0.45}  # the script's default shape (SMALL: 151,936-token vocabulary)
SMOLLM2_TARGETS = {"time_ratio": 0.4, "rss_ratio": 0.5}  # SmolLM2-135M's shape, and any other given


def default_targets(args) -> dict[str, float]:
    """The default engine's targets against TRL's default (fp32) step at this run's shape."""
    return SMALL_TARGETS if (args.hidden, args.vocab) == (SMALL["hidden"], SMALL["vocab"]) else SMOLLM2_TARGETS


def report(args, results: dict[str, dict]) -> dict:
    from grpo_engine.kernels import cpu_model

    print(f"CPU: {cpu_model()}")
    rows = [("engine", "params", "s/step (median)", "s/step (min)", "step times (s)", "peak RSS (MiB)",
             "mean compl. len", "threads")]
    for name, r in results.items():
        rows.append((name, f"{r['params']:,}", f"{r['sec_per_step']:.3f}", f"{min(r['step_times']):.3f}",
                     " ".join(f"{t:.2f}" for t in r["step_times"]), f"{r['peak_rss_mib']:.0f}",
                     f"{r['mean_completion_len']:.1f}", str(r["threads"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    summary = {"benchmark": "step_vs_trl", "cpu": cpu_model(), "prompts": args.prompts, "group": args.group,
               "max_new": args.max_new, "prompt_len": args.prompt_len, "steps": args.steps, "arch": args.arch,
               "dtype": {name: r.get("precision", "fp32") for name, r in results.items()},  # ours: as resolved
               "beta": 0.0, "mu": 1, "lr": LR,
               "trl_gradient_checkpointing": args.trl_gradient_checkpointing, "results": results}
    targets = [("ours", "trl", "", default_targets(args)),
               ("ours", "trl-bf16", "_trl_bf16", {"time_ratio": 0.6}),
               ("ours-fp32", "trl", "_fp32", {}),  # fp32 against fp32: reported, no target of its own
               ("ours-bf16", "trl-bf16", "_bf16", {})]  # bf16 against bf16: reported beside the default
    for mine, peer, suffix, limits in targets:
        if mine not in results or peer not in results:
            continue
        ratios = peer_ratios(results[mine], results[peer])
        summary.update({key + suffix: value for key, value in ratios.items()})
        summary.setdefault("targets_met", {}).update(
            {f"{key}{suffix}<={limit}": ratios[key] <= limit for key, limit in limits.items()})
        print(f"ratios ({mine} / {peer}): time {ratios['time_ratio']:.3f} (median of the step pairs after the first"
              + (f", target <= {limits['time_ratio']}" if "time_ratio" in limits else "")
              + f"; pairs {' '.join(f'{r:.3f}' for r in ratios['pair_time_ratios'])}; "
              f"medians {ratios['median_time_ratio']:.3f}; fastest steps {ratios['min_time_ratio']:.3f}), "
              f"peak RSS {ratios['rss_ratio']:.3f}" + (f" (target <= {limits['rss_ratio']})" if "rss_ratio" in limits
                                                      else ""))
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child == "trl":
        print(RESULT_TAG + json.dumps(trl_child(args)), flush=True)
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - set(ENGINE_COMMANDS):
        raise SystemExit(f"--engines {args.engines!r}: give a comma list of {', '.join(ENGINE_COMMANDS)}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else make_checkpoint(args, Path(tmp) / "model")
        results = run_interleaved({name: ENGINE_COMMANDS[name](args, model_dir) for name in engines}, Path(tmp))
    for name in ("ours", "ours-fp32", "ours-bf16"):
        if name in results:
            results[name]["mean_completion_len"] = float(args.max_new)  # bench_step never stops early
    print(json.dumps(report(args, results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
