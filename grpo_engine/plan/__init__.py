"""The memory planner: predicted peak GPU memory of one GRPO step, per phase (memory.py), what to change when it
does not fit (suggest.py), the shapes it knows (shapes.py), driven by a training config (from_config.py) and the
`grpo plan` command (cli.py)."""

from .memory import GIB, MIB, MemoryPlan, Phase, PlanInput, fits, kv_cache_bytes, param_counts, plan_memory
from .shapes import MODEL_SHAPES, model_shape
from .suggest import format_plan, suggest

__all__ = ["GIB", "MIB", "MODEL_SHAPES", "MemoryPlan", "Phase", "PlanInput", "fits", "format_plan",
           "kv_cache_bytes", "model_shape", "param_counts", "plan_memory", "suggest"]
