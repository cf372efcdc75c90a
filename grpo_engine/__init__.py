"""grpo-engine: native-PyTorch GRPO training for small reasoning models on one consumer GPU.

The public names below are imported on first use (PEP 562), so that `import grpo_engine.config` and
`grpo --help` do not pay for importing torch.
"""

import os
from importlib import import_module

# MKL's own memory manager keeps the work buffers of every GEMM shape it has seen for reuse, and never hands them
# back: 350-400 MiB of peak RSS in `grpo bench step` at the SmolLM2-135M shape on an Intel Xeon (docs/memory.md),
# for no measurable speed. MKL reads this when torch loads it, so it is set here, before anything imports torch
# (it has no effect in a process that imported torch before grpo_engine); a value the user set is kept.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

_PUBLIC = {
    "CheckpointError": ".model.hf_io",
    "load_model": ".model.hf_io",
    "save_model": ".model.hf_io",
    "Tokenizer": ".model.tokenizer",
    "load_tokenizer": ".model.tokenizer",
    "GenerationOutput": ".rollout",
    "SamplingParams": ".rollout",
    "generate": ".rollout",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'grpo_engine' has no attribute {name!r}")
    return getattr(import_module(_PUBLIC[name], __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
