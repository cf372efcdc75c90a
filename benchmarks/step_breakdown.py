"""How far can a GRPO step get to its matmul floor? One step under torch.profiler, split into its matrix products
and everything else, phase by phase, beside the floor of `grpo bench step` (grpo_engine/bench/floor.py).

    python benchmarks/step_breakdown.py --model DIR                      # 4 x 8 x 64 after 32-token prompts
    python benchmarks/step_breakdown.py --model DIR memory.activation_checkpointing=none
    python benchmarks/step_breakdown.py --model DIR --precision bf16       # bf16 weights, against a bf16 GEMM

The floor is the step's matmul FLOPs over the best rate of one large GEMM in the step's precision (--precision, the
config's memory.precision; bench/floor.py gemm_rates); here the best of three measurements (before each of the last
two steps and after the last), as this machine's speed drifts. A step
cannot beat the time its own products take at their own shapes, so `products / floor` is the closest this CPU's
GEMM libraries let the step come to the floor even if every other op (norms, RoPE, SwiGLU, softmax, the
optimizer, Python) took no time; `other` is that remaining work. Of it, the optimizer step (its whole time in the
profile, `optimizer_s`) moves every parameter's master weight and moments through memory and cannot fuse into a
product: `(products + optimizer) / floor` bounds how near the update can come with its products at their in-place
rates. The products are the leaf ops that multiply
matrices (torch.mm and addmm, bmm, MKL's and oneDNN's linear, SDPA), timed by their own (self) time in the
profiled step. A phase's wall time is its time in the step before, run without the profiler (which adds about a
fifth to an update); the steps before the profiled one warm the kernels up.
Prints a table, then one JSON line. CPU only. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PRODUCT_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::dot",
    "mkl::_mkl_linear", "mkldnn::_linear_pointwise",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
})


def phase_seconds(prof) -> tuple[float, float, float]:
    """(products, everything profiled, optimizer) in seconds: the self time of the product ops and of all ops, and
    the whole (inclusive) time of the optimizer's step, which torch.optim records as `Optimizer.step#<class>.step`."""
    products = total = optimizer = 0.0
    for evt in prof.key_averages():
        total += evt.self_cpu_time_total
        if evt.key in PRODUCT_OPS:
            products += evt.self_cpu_time_total
        if evt.key.startswith("Optimizer.step#"):
            optimizer += evt.cpu_time_total
    return products / 1e6, total / 1e6, optimizer / 1e6


class PhaseProfiles:
    """Inside: the step's phases (module attributes grpo_step looks up at call time) run in their own profiler
    while `on` is set; `results` keeps each phase's (products, ops) seconds and its wall time profiled and not:
    `wall_s` is the phase's time in the last step run without the profiler, whose recording of every op adds
    about a fifth to an update's wall time. Restored on exit."""

    def __init__(self, step_module, phases: dict[str, str]):
        self.module, self.phases = step_module, phases
        self.on, self.results, self.saved, self.walls = False, {}, {}, {}

    def __enter__(self):
        for attr, name in self.phases.items():
            self.saved[attr] = getattr(self.module, attr)
            setattr(self.module, attr, self._wrap(self.saved[attr], name))
        return self

    def __exit__(self, *exc):
        for attr, fn in self.saved.items():
            setattr(self.module, attr, fn)

    def _wrap(self, fn, name: str):
        from torch.profiler import ProfilerActivity, profile

        def profiled(*args, **kwargs):
            t0 = time.perf_counter()
            if not self.on:
                out = fn(*args, **kwargs)
                self.walls[name] = time.perf_counter() - t0
                return out
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = fn(*args, **kwargs)
                wall = time.perf_counter() - t0  # before the profiler's own processing at exit
            self.results[name] = {"wall_s": self.walls.get(name, wall), "profiled_wall_s": wall,
                                  **dict(zip(("products_s", "ops_s", "optimizer_s"), phase_seconds(prof)))}
            return out

        return profiled


def measure(args) -> dict:
    import grpo_engine.train.step as step_module
    from grpo_engine.bench.floor import gemm_rates, weights_precision
    from grpo_engine.bench.step import bench_inputs, step_matmul_flops
    from grpo_engine.kernels import cpu_model

    sizes = dict(prompts=args.prompts, group=args.group, max_new=args.max_new, prompt_len=args.prompt_len)
    overrides = ["model.device=cpu", f"memory.precision={args.precision}", *args.overrides]  # a CPU floor
    inputs, state = bench_inputs(args.model, **sizes, steps=args.steps, overrides=overrides)
    precision = weights_precision(inputs.policy.model)  # what the step runs in: its floor's rate is measured in it
    phases = {"collect_groups": "generate", "attach_logprobs": "logprobs", "update_step": "update"}
    times, rates = [], []
    with PhaseProfiles(step_module, phases) as profiles:
        for step in range(1, args.steps + 1):
            profiles.on = step == args.steps
            if step >= args.steps - 1:
                rates.append(gemm_rates(precision=precision))
            times.append(step_module.grpo_step(inputs, state, step, message=lambda _: None).metrics.time_step_s)
    rates.append(gemm_rates(precision=precision))
    rate = max(max(r.values()) for r in rates)  # the best seen around the last two steps: the speed drifts
    flops = step_matmul_flops(inputs, prompt_len=args.prompt_len, max_new=args.max_new)
    gflop = {"generate": flops.generate / 1e9, "logprobs": flops.logprobs / 1e9, "update": flops.update / 1e9}
    return report(profiles.results, gflop, rate, times, cpu_model(), precision)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def report(results: dict, gflop: dict[str, float], rate: float, times: list[float], cpu: str,
           precision: str = "fp32") -> dict:
    """Per phase: its floor (its GFLOP at the GEMM rate, GFLOP/s), wall time, product time, both over the floor.
    `rate` is the GEMM rate in `precision`, the precision the step ran in."""
    phases = {}
    for name, r in results.items():
        phases[name] = {**r, "floor_s": gflop[name] / rate, "products_gflops": ratio(gflop[name], r["products_s"]),
                        "wall_over_floor": ratio(r["wall_s"] * rate, gflop[name]),
                        "products_over_floor": ratio(r["products_s"] * rate, gflop[name]),
                        "bound_over_floor": ratio((r["products_s"] + r.get("optimizer_s", 0.0)) * rate, gflop[name])}
    floor = sum(gflop.values()) / rate
    products = sum(r["products_s"] for r in results.values())
    step = times[-2]  # the last step's own time includes the profiler's processing
    return {"cpu": cpu, "precision": precision, "gemm_gflops": rate, "floor_s": floor, "step_s": step,
            "products_s": products, "step_over_floor": step / floor, "products_over_floor": products / floor,
            "phases": phases}


def show(r: dict) -> None:
    print(f"{r['cpu']}: {r['precision']} GEMM {r['gemm_gflops']:.0f} GFLOP/s, step floor {r['floor_s']:.2f} s")
    print(f"{'phase':<9} {'floor s':>8} {'wall s':>8} {'products s':>11} {'GFLOP/s':>8} {'other s':>8} "
          f"{'wall/floor':>11} {'products/floor':>15}")
    for name, p in r["phases"].items():
        print(f"{name:<9} {p['floor_s']:8.2f} {p['wall_s']:8.2f} {p['products_s']:11.2f} {p['products_gflops']:8.0f} "
              f"{p['wall_s'] - p['products_s']:8.2f} {p['wall_over_floor']:10.2f}x {p['products_over_floor']:14.2f}x")
    update = r["phases"].get("update")
    if update:
        print(f"update: its optimizer step {update.get('optimizer_s', 0.0):.2f} s; products + optimizer = "
              f"{update['bound_over_floor']:.2f}x the floor")
    print(f"step (the one before the profiled one): {r['step_s']:.2f} s = {r['step_over_floor']:.2f}x the floor; "
          f"the profiled step's products alone: {r['products_s']:.2f} s = {r['products_over_floor']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="steps run (at least 2); the last is profiled")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="memory.precision of the step; the floor's GEMM rate is measured in it")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. memory.activation_checkpointing=none")
    args = p.parse_args()
    if any(o.split("=", 1)[0].strip() == "memory.precision" for o in args.overrides):
        p.error("set the step's precision with --precision fp32|bf16, not a memory.precision= override")
    if args.steps < 2:
        p.error("--steps must be at least 2: the last is profiled, the one before it gives the step's time")
    r = measure(args)
    show(r)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
