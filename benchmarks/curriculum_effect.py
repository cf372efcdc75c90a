"""Does the curriculum help? The demo task (`grpo demo`: a tiny model warm-started on 2-digit addition by a
sloppy teacher, then GRPO against the exact answer) trained with each curriculum mode from the same warm start,
for several seeds; held-out greedy accuracy at the end and the steps each run needs to reach a target accuracy.

    python benchmarks/curriculum_effect.py --seeds 0 1 2                       # the full comparison (~hour on 2 cores)
    python benchmarks/curriculum_effect.py --seeds 0 --quick                   # a smoke run of the same pipeline
    python benchmarks/curriculum_effect.py --seeds 0 1 2 curriculum.every=5    # dotted overrides for every run

Pipeline, per seed s:
  (a) the demo recipe (recipes/demo.yaml) with seed=s, its warm start (tiny base + SFT, both seeded by s)
      written once to OUT/seed-s/sft and shared by every mode: the modes differ in the curriculum alone;
  (b) for each --modes entry: train(cfg) from that SFT checkpoint with curriculum.mode=MODE (the recipe's own
      eval every `eval.every` steps on the fixed held-out subset gives the accuracy curve), then greedy
      held-out accuracy of the final checkpoint (grpo_engine.demo.held_out, as `grpo demo` reports it);
  (c) the target accuracy: --target, or the mean final accuracy of the first mode (the baseline, `none`);
      steps to reach it = the first eval step whose held-out accuracy is >= the target (None: never);
  (d) a table per mode (mean / min / max over seeds) and one JSON line tagged RESULT_JSON.
The extra generation of a curriculum run (curriculum_gen_tokens in metrics.jsonl) is reported next to the
rollout's own (gen_tokens): the cost side of the comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))
RESULT_TAG = "RESULT_JSON "
QUICK = ("warm_start.tiny.hidden_size=64", "warm_start.tiny.num_hidden_layers=2", "warm_start.sft.steps=30",
         "schedule.steps=4", "rollout.prompts_per_step=2", "rollout.group_size=4", "eval.every=2",
         "eval.max_examples=16", "curriculum.every=2", "curriculum.pool_size=4", "curriculum.samples=2")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted overrides of the demo recipe for every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=["none", "semantic_entropy"],
                   help="curriculum modes to compare; the first is the baseline that sets the default target")
    p.add_argument("--target", type=float, default=None,
                   help="held-out accuracy to reach (default: the baseline's mean final accuracy)")
    p.add_argument("--out", default="runs/curriculum_effect", help="run directories go under here")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tiny model, 4 steps)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    return p.parse_args(argv)


def load(overrides: list[str]):
    from grpo_engine.config import load_config
    from grpo_engine.demo import DEMO_RECIPE

    return load_config(Path(str(DEMO_RECIPE)), overrides)


def warm_started(base: list[str], seed: int, out: Path) -> Path:
    """OUT/seed-s/sft: the demo's warm start for seed s (reused when it is already there)."""
    from grpo_engine.sft.warm_start import warm_start
    from grpo_engine.train.setup import task_of

    cfg = load([*base, f"seed={seed}", f"run_dir={out / f'seed-{seed}'}", f"warm_start.tiny.seed={seed}",
                f"warm_start.sft.seed={seed}"])
    return warm_start(cfg, task_of(cfg))


def one_run(base: list[str], seed: int, mode: str, sft: Path, out: Path) -> dict:
    """GRPO from `sft` with curriculum.mode=mode; its accuracy curve, final accuracy and generation cost."""
    from grpo_engine.demo import held_out
    from grpo_engine.train.loop import train
    from grpo_engine.train.setup import task_of

    cfg = load([*base, f"seed={seed}", f"run_dir={out / f'seed-{seed}-{mode}'}", f"curriculum.mode={mode}",
                f"model.path={sft}", "warm_start.tiny.arch=''", "warm_start.sft.steps=0"])  # from the shared SFT
    t0 = time.perf_counter()
    result = train(cfg, overwrite=True)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    final = held_out(result.checkpoint / "model", cfg, task_of(cfg)).accuracy
    return {"seed": seed, "mode": mode, "final_accuracy": final, "curve": curve, "seconds": seconds,
            "gen_tokens": sum(r["gen_tokens"] for r in rows),
            "curriculum_gen_tokens": sum(r.get("curriculum_gen_tokens") or 0 for r in rows)}


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first eval step whose held-out accuracy reaches `target` (None: never)."""
    return next((step for step, acc in curve if acc >= target - 1e-12), None)


def summarise(runs: list[dict], modes: list[str], target: float) -> dict:
    """Per mode: final accuracy (mean, min, max over seeds), steps to the target, generation cost."""
    out = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        acc = [r["final_accuracy"] for r in mine]
        reached = [s for s in (steps_to(r["curve"], target) for r in mine) if s is not None]
        out[mode] = {"final_accuracy_mean": statistics.fmean(acc), "final_accuracy_min": min(acc),
                     "final_accuracy_max": max(acc), "steps_to_target_mean": statistics.fmean(reached) if reached
                     else None, "reached": f"{len(reached)}/{len(mine)}",
                     "gen_tokens_mean": statistics.fmean(r["gen_tokens"] for r in mine),
                     "curriculum_gen_tokens_mean": statistics.fmean(r["curriculum_gen_tokens"] for r in mine),
                     "seconds_mean": statistics.fmean(r["seconds"] for r in mine)}
    return out


def print_table(summary: dict, target: float, seeds: list[int]) -> None:
    print(f"\nheld-out greedy accuracy over seeds {seeds}; target {target:.3f}")
    print(f"{'mode':<18}{'final acc (mean)':>18}{'min':>8}{'max':>8}{'steps to target':>17}{'reached':>9}"
          f"{'gen tok':>10}{'+ curric. tok':>15}{'s / run':>9}")
    for mode, s in summary.items():
        steps = f"{s['steps_to_target_mean']:.1f}" if s["steps_to_target_mean"] is not None else "never"
        print(f"{mode:<18}{s['final_accuracy_mean']:>18.3f}{s['final_accuracy_min']:>8.3f}"
              f"{s['final_accuracy_max']:>8.3f}{steps:>17}{s['reached']:>9}{s['gen_tokens_mean']:>10.0f}"
              f"{s['curriculum_gen_tokens_mean']:>15.0f}{s['seconds_mean']:>9.0f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        from grpo_engine.kernels.threads import fix_threads  # the engine's plan keeps this count

        fix_threads(args.threads)
    base = [*(QUICK if args.quick else ()), *args.overrides]
    out = Path(args.out)
    runs = []
    for seed in args.seeds:
        sft = warm_started(base, seed, out)
        for mode in args.modes:
            runs.append(one_run(base, seed, mode, sft, out))
            print(f"seed {seed} {mode}: final held-out accuracy {runs[-1]['final_accuracy']:.3f}", flush=True)
    baseline = [r["final_accuracy"] for r in runs if r["mode"] == args.modes[0]]
    target = args.target if args.target is not None else statistics.fmean(baseline)
    summary = summarise(runs, args.modes, target)
    print_table(summary, target, args.seeds)
    print(RESULT_TAG + json.dumps({"seeds": args.seeds, "target": target, "overrides": base, "summary": summary,
                                   "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
