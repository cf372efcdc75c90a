"""The decode loops of one or two checkouts, timed on the CPU, interleaved: single-turn completions (`grpo bench
generate`'s prompts and call) and a multi-turn rollout with environment turns, at the SMALL shape and the
SmolLM2-135M shape, random weights.

    python benchmarks/decode_loops.py                           # this checkout's loops, 5 runs each
    python benchmarks/decode_loops.py --tree /path/to/main      # ... and another checkout's, interleaved with them
    python benchmarks/decode_loops.py --runs 2 --shapes tiny --prompts 2 --group 2 --max-new 8   # a plumbing check

What runs: one child process per (checkout, loop), each importing grpo_engine from its checkout (PYTHONPATH), the
loops a checkout offers on a CPU (rollout/generate.py LOOPS without `graphs`: a tree with the dynamic loop offers
`dynamic` and `static`, one with the one loop `static`). Every child loads the same random checkpoint, then waits
for its turn before its warm-up and before each timed call (grpo_engine/bench/turns.py), so the calls of the loops
alternate and each round sees the machine at the same speed. After its last timed call each child decodes the same
prompts greedily, alone on the machine, and reports a hash of the tokens: the loops' greedy tokens must be identical
(the sampled ones may differ: each loop has its random stream).

Printed per workload and shape: each loop's median seconds of its N calls, their spread (min-max), tokens/s and the
median's ratio to the first loop's, and whether the greedy tokens agree. Rows finish at different steps: besides
EOS, a fraction of the vocabulary (--stop-rate, 1/32 by default) ends a completion or a model turn, so the loops'
handling of finished rows (compaction, bucket step-down) is part of what is timed. Run it on a quiet machine: on a
shared one (other processes on its cores) the figures mean little.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "RESULT_JSON "
SHAPES = {  # name -> (make_tiny_checkpoint arch, shape), as benchmarks/generate_vs_hf.py makes them
    # SMALL, the speed targets' shape: Qwen2-style, 8 layers of 512, the LM head tied (100.3M parameters)
    "small": ("qwen2", dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                            intermediate_size=1408, vocab_size=151936, tie_word_embeddings=True)),
    # SmolLM2-135M-Instruct's config (Llama, tied, no RoPE scaling)
    "smollm2": ("llama3", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                               rope_theta=100000.0, rope_scaling=None, rms_norm_eps=1e-5,
                               max_position_embeddings=8192)),
    "tiny": ("qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=4096)),  # the plumbing check's
}
WORKLOADS = ("generate", "tools")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", help="another checkout (its root, holding grpo_engine/) whose loops run interleaved "
                                  "with this one's, e.g. the tree before a change")
    p.add_argument("--runs", type=int, default=5, help="timed calls per loop (median and min-max of these)")
    p.add_argument("--shapes", default="small,smollm2", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list: generate (single-turn "
                   "completions, `grpo bench generate`'s call), tools (multi-turn trajectories)")
    p.add_argument("--prompts", type=int, default=4, help="prompts P (tools: examples)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt G (tools: trajectories per example)")
    p.add_argument("--max-new", type=int, default=64, help="max new tokens (tools: of one model turn)")
    p.add_argument("--turns", type=int, default=3, help="tools: model turns per trajectory")
    p.add_argument("--tool-words", type=int, default=12, help="tools: words of each environment turn")
    p.add_argument("--stop-rate", type=float, default=1 / 32,
                   help="fraction of the vocabulary that ends a completion or turn (0: EOS only)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", help="directory for the random checkpoints (default: a temporary one)")
    p.add_argument("--json", help="also write every figure to this JSON file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--loop", help=argparse.SUPPRESS)
    p.add_argument("--turn-fds", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES] + [
        w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown shape or workload {unknown}: shapes are {', '.join(SHAPES)}; workloads "
                f"{', '.join(WORKLOADS)}")
    if args.tree and not (Path(args.tree) / "grpo_engine").is_dir():
        p.error(f"--tree {args.tree} holds no grpo_engine/: give the root of a checkout")
    return args


# ------------------------------------------------------------------------------------------ the child


def stop_ids(vocab: int, rate: float, eos: list[int]) -> list[int]:
    """EOS and every round(1 / rate)-th token id: a random model then ends a row at about `rate` per step."""
    step = round(1 / rate) if rate > 0 else 0
    return sorted(set(eos) | (set(range(step - 1, vocab, step)) if step else set()))


class EchoTools:
    """An environment whose every turn is a tool call: it answers with `words` words, for `turns` model turns."""

    def __init__(self, words: int, turns: int, budget: int):
        from grpo_engine.tasks.environment import TrajectoryLimits

        self.words, self.limits, self.tools, self.stop_strings = words, TrajectoryLimits(turns, budget), [], []

    def reset(self, example):
        from grpo_engine.tasks.base import Prompt

        return Prompt([{"role": "user", "content": example.question}])

    def step(self, completion: str):
        from grpo_engine.tasks.environment import StepResult

        return StepResult([{"role": "tool", "content": "ok " * self.words}], {"turn": 1.0}, 0.5, tool_calls=1)


def workload_call(args, model, tok):
    """-> call(temperature) running the workload once: (new tokens, the rows' token lists)."""
    from grpo_engine.bench.generate import QUESTIONS, bench_prompts
    from grpo_engine.rollout import SamplingParams, generate

    stops = stop_ids(model.config.vocab_size, args.stop_rate, list(tok.eos_token_ids))
    loop = args.loop or None
    if args.workload == "generate":
        prompts = bench_prompts(tok, args.prompts)

        def call(temperature: float):
            params = SamplingParams(n=args.group, temperature=temperature, max_new_tokens=args.max_new,
                                    stop_token_ids=stops, max_tokens_in_flight=None, cuda_graphs="off")
            out = generate(model, prompts, params, seed=[args.seed + i for i in range(len(prompts))], loop=loop)
            return out.num_tokens, out.completion_ids

        return call
    from grpo_engine.rollout.multiturn import run_multiturn
    from grpo_engine.tasks.base import Example

    examples = [Example(str(i), QUESTIONS[i % len(QUESTIONS)], "") for i in range(args.prompts)
                for _ in range(args.group)]
    budget = args.turns * (args.max_new + 4 * args.tool_words + 32)

    def call(temperature: float):
        params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new, stop_token_ids=stops,
                                cuda_graphs="off")
        envs = [EchoTools(args.tool_words, args.turns, budget) for _ in examples]
        trajs = run_multiturn(model, tok, envs, examples, params,
                              seed=[args.seed + i for i in range(len(examples))], loop=loop)
        return sum(t.metrics.model_tokens for t in trajs), [t.token_ids for t in trajs]

    return call


def run_child(args) -> None:
    """Load, warm up, then per turn one timed call; after the last, the greedy tokens (alone); one result line."""
    import torch

    from grpo_engine.bench.turns import StepTurns
    from grpo_engine.kernels import apply_kernels
    from grpo_engine.model.loading import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    turns = StepTurns.parse(args.turn_fds)
    model = apply_kernels(load_model(args.ckpt, dtype=getattr(torch, args.dtype)))
    call = workload_call(args, model, load_tokenizer(args.ckpt))
    turns.wait()
    call(args.temperature)  # warm-up, alone too: kernels' first calls, allocator (oversubscribed cores crawl)
    seconds, tokens = [], []
    for _ in range(args.runs):
        turns.wait()
        t0 = time.perf_counter()
        n, _ = call(args.temperature)
        seconds.append(time.perf_counter() - t0)
        tokens.append(n)
    n, rows = call(0.0)  # greedy: must be the same tokens for every loop
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    print(RESULT_TAG + json.dumps({"seconds": seconds, "tokens": tokens, "greedy_tokens": n, "greedy_hash": digest}),
          flush=True)


# ------------------------------------------------------------------------------------------ the driver


def loops_of(tree: Path) -> list[str]:
    """The loops `tree` offers on a CPU (its rollout/generate.py LOOPS, `graphs` left out)."""
    code = "from grpo_engine.rollout.generate import LOOPS; print(','.join(l for l in LOOPS if l != 'graphs'))"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(tree), capture_output=True, text=True,
                         check=True, cwd=tree)
    return out.stdout.strip().split(",")


def child_env(tree: Path) -> dict:
    """grpo_engine imported from `tree` only (this script's own directory holds no package)."""
    return dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


class Child:
    """One loop's process with its turn pipe: it runs a timed call only when given the turn."""

    def __init__(self, label: str, tree: Path, cmd: list[str]):
        go_read, self.go_write = os.pipe()
        self.ready_read, ready_write = os.pipe()
        self.label = label
        self.proc = subprocess.Popen([*cmd, "--turn-fds", f"{go_read},{ready_write}"], env=child_env(tree),
                                     cwd=tree, pass_fds=(go_read, ready_write), stdout=subprocess.PIPE, text=True)
        os.close(go_read)
        os.close(ready_write)

    def wait_ready(self) -> None:
        """Block until the child is ready for its next call, or has exited (its result then follows)."""
        os.read(self.ready_read, 1)

    def give_turn(self) -> None:
        os.write(self.go_write, b"G")

    def result(self) -> dict:
        out, _ = self.proc.communicate()
        for fd in (self.go_write, self.ready_read):
            os.close(fd)
        lines = [line for line in out.splitlines() if line.startswith(RESULT_TAG)]
        if self.proc.returncode or not lines:
            raise RuntimeError(f"{self.label}: the child failed (exit {self.proc.returncode}); its stderr is above")
        return json.loads(lines[-1][len(RESULT_TAG):])


def child_cmd(args, ckpt: Path, workload: str, loop: str) -> list[str]:
    flags = ["--child", "--ckpt", str(ckpt), "--workload", workload, "--loop", loop, "--runs", str(args.runs)]
    for name in ("prompts", "group", "max_new", "turns", "tool_words", "stop_rate", "temperature", "dtype",
                 "threads", "seed"):
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return [sys.executable, str(Path(__file__).resolve()), *flags]


def interleaved(children: list[Child], runs: int) -> list[dict]:
    """Each child's warm-up in turn, then `runs` rounds of one call each (the order rotating round by round), then
    each child's greedy check alone (a child's last turn lasts until it exits). Nothing runs beside a call: two
    children's threads on the same cores spin-wait on each other and slow down many times over."""
    for c in children:
        c.wait_ready()
        c.give_turn()
        c.wait_ready()
    for r in range(runs):
        for c in children[r % len(children):] + children[: r % len(children)]:
            c.give_turn()
            c.wait_ready()
    return [c.result() for c in children]


def summary(label: str, result: dict, base: dict | None) -> dict:
    """One loop's figures: median seconds, spread (min-max), tokens/s and the median's ratio to `base`'s."""
    s = result["seconds"]
    median = statistics.median(s)
    rate = statistics.median(t / x for t, x in zip(result["tokens"], s))
    row = {"loop": label, "median_s": median, "min_s": min(s), "max_s": max(s), "tokens_per_s": rate,
           "greedy_hash": result["greedy_hash"], "greedy_tokens": result["greedy_tokens"]}
    if base is not None:
        row["ratio"] = median / statistics.median(base["seconds"])
        row["greedy_same"] = result["greedy_hash"] == base["greedy_hash"]
    return row


def checkpoint(args, shape: str, root: Path) -> Path:
    from grpo_engine.model.tiny import make_tiny_checkpoint

    out = root / shape
    if not (out / "config.json").exists():
        arch, dims = SHAPES[shape]
        make_tiny_checkpoint(out, arch, seed=args.seed, **dims)
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return []
    sys.path.insert(0, str(REPO))  # the driver makes the checkpoints with this checkout's code
    trees = [("this", REPO)] + ([("tree", Path(args.tree).resolve())] if args.tree else [])
    variants = [(f"{name}:{loop}", tree, loop) for name, tree in trees for loop in loops_of(tree)]
    root = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="decode_loops_"))
    rows = []
    for shape in args.shapes.split(","):
        ckpt = checkpoint(args, shape, root)
        for workload in args.workloads.split(","):
            children = [Child(label, tree, child_cmd(args, ckpt, workload, loop)) for label, tree, loop in variants]
            results = interleaved(children, args.runs)
            for (label, _, _), result in zip(variants, results):
                rows.append({"shape": shape, "workload": workload,
                             **summary(label, result, results[0] if result is not results[0] else None)})
            if args.json:  # after each workload: a run stopped later keeps what it measured
                Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print_table(rows, args)
    return rows


def print_table(rows: list[dict], args) -> None:
    print(f"{args.runs} interleaved calls per loop, P={args.prompts} x G={args.group}, max_new={args.max_new}, "
          f"stop rate {args.stop_rate:g}, {args.dtype}")
    print(f"{'shape':8} {'workload':9} {'loop':16} {'median s':>9} {'min-max s':>15} {'tok/s':>8} {'ratio':>6} greedy")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "1"
        same = "base" if "greedy_same" not in r else ("same" if r["greedy_same"] else "DIFFERS")
        print(f"{r['shape']:8} {r['workload']:9} {r['loop']:16} {r['median_s']:9.3f} "
              f"{r['min_s']:7.3f}-{r['max_s']:<7.3f} {r['tokens_per_s']:8.1f} {ratio:>6} {same}")


if __name__ == "__main__":
    main()
