"""Print the memory planner's predictions for the shipped GPU presets (configs/gpu*gb_*.yaml) and for
hand-picked variants around them (docs/memory.md).

    PYTHONPATH=. python benchmarks/memory_plan.py [--verbose]

Predictions only: GPU measurement is a separate step (grpo bench step ... --json reports peak memory).
"""

import re
import sys
from pathlib import Path

from grpo_engine.config import load_config
from grpo_engine.plan import MODEL_SHAPES, MemoryPlan, PlanInput, fits, format_plan, plan_memory
from grpo_engine.plan.from_config import plan_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

ROLLOUT = dict(prompts_per_step=8, group_size=8, prompt_len=256, completion_len=512)
PRESETS = [
    ("8 GB: 1.5B QLoRA", "qwen2.5-1.5b", 8,
     dict(mode="qlora", activation_checkpointing="all", micro_batch_rows=2)),
    ("8 GB: 1.5B QLoRA, lean", "qwen2.5-1.5b", 8,
     dict(mode="qlora", activation_checkpointing="all", micro_batch_rows=1, logprob_chunk=256)),
    ("8 GB: 0.5B full, 8-bit AdamW", "qwen2.5-0.5b", 8,
     dict(optimizer="adamw_8bit", activation_checkpointing="all", micro_batch_rows=2)),
    ("8 GB: 0.5B full, AdamW fp32 master", "qwen2.5-0.5b", 8,
     dict(optimizer="adamw", activation_checkpointing="all", micro_batch_rows=2)),
    ("12 GB: 1.5B LoRA", "qwen2.5-1.5b", 12,
     dict(mode="lora", activation_checkpointing="all", micro_batch_rows=4)),
    ("24 GB: 3B full, CPU-offloaded AdamW", "qwen2.5-3b", 24,
     dict(optimizer="adamw_offload", activation_checkpointing="all", micro_batch_rows=2)),
    ("24 GB: 3B full, fp32 + AdamW (no tricks)", "qwen2.5-3b", 24, dict(precision="fp32")),
]


def row(name: str, plan: MemoryPlan, card: float) -> str:
    tr, ro = plan.phase("training").components, plan.phase("rollout").components
    g = 1024**3
    return (f"| {name} | {plan.peak_phase} | {tr['weights'] / g:.2f} | {tr['optimizer state'] / g:.2f} | "
            f"{ro['kv cache'] / g:.2f} | {tr['saved activations'] / g:.2f} | {plan.total_gib:.2f} GiB | "
            f"{'yes' if fits(plan, card) else 'NO'} |")


def main() -> None:
    verbose = "--verbose" in sys.argv
    header = ("| {} | peak phase | weights | optimizer (GPU) | KV cache | activations | predicted | fits |\n"
              "|---|---|---|---|---|---|---|---|")
    print(header.format("preset file (card)"))
    for path in sorted(CONFIGS.glob("gpu*gb_*.yaml")):
        shape = re.search(r"qwen2\.5-[\d.]+b", path.name).group(0)  # weights need not be downloaded
        cfg = load_config(path)
        plan = plan_config(cfg, shape)
        print(row(f"`{path.name}` ({cfg.memory.gpu_memory_gib:g} GiB)", plan, cfg.memory.gpu_memory_gib))
        if verbose:
            print(format_plan(plan, cfg.memory.gpu_memory_gib))
    print()
    print(header.format("variant"))
    for name, model, card, kw in PRESETS:
        plan = plan_memory(MODEL_SHAPES[model], PlanInput(**ROLLOUT, **kw))
        print(row(name, plan, card))
        if verbose:
            print(format_plan(plan, card))


if __name__ == "__main__":
    main()
