"""Where does the time of a GRPO step go? Runs train(cfg) with wall-clock timers wrapped around its phases.

    python benchmarks/profile_step.py --model runs/demo/sft --steps 60            # the efficacy_vs_trl setup
    python benchmarks/profile_step.py --model runs/demo/sft --set memory.share_prompt_forward=false

The config is the one benchmarks/efficacy_vs_trl.py gives our engine (demo task, P=8 x G=8, max_new 8,
fp32, no eval, final checkpoint only); `--set key=value` adds overrides. Timers wrap the functions the loop
and the update look up at call time (module attributes), so nothing in grpo_engine changes; nested phases
are reported under their parent. The first `--warmup` steps are excluded from the per-step figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TASK = {"digits": 2, "operations": ["+"], "n_train": 9800, "n_test": 200, "seed": 0, "format": "bare_number",
        "extractors": ["last_number"]}


class Timers:
    """Accumulated wall time per phase name, only counted once `active` is set (after the warm-up)."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = False

    def add(self, name: str, seconds: float) -> None:
        if self.active:
            self.total[name] += seconds
            self.calls[name] += 1

    def wrap(self, module, attr: str, name: str) -> None:
        fn = getattr(module, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        setattr(module, attr, timed)


def config(args, run_dir: str):
    from grpo_engine.config import load_config

    overrides = [
        "seed=0", f"run_dir={run_dir}", f"model.path={args.model}", "model.device=cpu", "memory.precision=fp32",
        "task.name=arithmetic", f"task.options={json.dumps(TASK)}", "rollout.prompts_per_step=8",
        "rollout.group_size=8", "rollout.max_new_tokens=8", "rollout.temperature=1.0", "algorithm.beta=0.0",
        "algorithm.mu=1", "optimizer.lr=2e-4", "optimizer.betas=[0.9,0.99]", "optimizer.weight_decay=0.0",
        "optimizer.grad_clip=1.0", f"schedule.steps={args.steps}", "schedule.lr_schedule=constant",
        "schedule.warmup_steps=0", "logging.progress=false", "logging.samples_every=0", "checkpoint.every=0",
        "checkpoint.keep_last=1", "eval.every=0", *args.set,
    ]
    return load_config(None, overrides)


def instrument(timers: Timers) -> None:
    import torch

    from grpo_engine.collect import groups as rollouts
    from grpo_engine.train import loop, update

    for module, attr, name in [
        (loop, "collect_groups", "rollout (generate + score)"),
        (rollouts, "generate", "  generate"),
        (rollouts, "safe_reward", "  reward"),
        (loop, "train_batch", "advantages + batch"),
        (loop, "update_policy", "update (fwd, bwd, clip, optimizer)"),
        (update, "completion_hidden", "  forward to hidden states"),
        (update, "token_logprobs", "  LM head + log-probs"),
        (update, "policy_loss", "  policy loss"),
        (torch.autograd, "backward", "  backward"),
        (loop, "clip_and_check", "  clip grad norm"),
        (loop, "step_metrics", "metrics"),
        (loop, "save_checkpoint", "checkpoint"),
    ]:
        timers.wrap(module, attr, name)
    real_build = loop.build_optimizer

    def build(*a, **k):
        opt = real_build(*a, **k)  # timed through hooks: the LR scheduler wraps .step itself
        started = {}
        opt.register_step_pre_hook(lambda *_: started.update(t=time.perf_counter()))
        opt.register_step_post_hook(lambda *_: timers.add("  optimizer step", time.perf_counter() - started["t"]))
        return opt

    loop.build_optimizer = build


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="SFT checkpoint (e.g. runs/demo/sft from `grpo demo`)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from the figures")
    p.add_argument("--set", action="append", default=[], help="extra config override key=value")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)


    from grpo_engine.kernels.threads import fix_threads  # the engine's plan keeps this count
    from grpo_engine.monitor import Monitor
    from grpo_engine.train import loop

    fix_threads(args.threads)
    timers = Timers()
    instrument(timers)
    real_log = Monitor.log_step
    clock = {"start": None}

    def log_step(self, metrics):
        real_log(self, metrics)
        if metrics.step == args.warmup:
            timers.active, clock["start"] = True, time.perf_counter()

    Monitor.log_step = log_step
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(args, tmp)
        loop.train(cfg)
        wall = time.perf_counter() - clock["start"]
        lines = [json.loads(s) for s in (Path(tmp) / "metrics.jsonl").open()]
    steps = args.steps - args.warmup
    print(f"{steps} steps after {args.warmup} warm-up, {args.threads} thread(s): {1000 * wall / steps:.2f} ms/step "
          f"(includes the final checkpoint)")
    for name, total in timers.total.items():
        print(f"  {name:<38} {1000 * total / steps:8.2f} ms/step  ({timers.calls[name]} calls)")
    rewards = [r["reward_mean"] for r in lines if "reward_mean" in r]
    print(f"reward mean over all steps {sum(rewards) / len(rewards):.4f}; last step loss {lines[-1].get('loss')}")
    print(json.dumps({"ms_per_step": 1000 * wall / steps, "phases_ms": {k.strip(): 1000 * v / steps
                                                                         for k, v in timers.total.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
