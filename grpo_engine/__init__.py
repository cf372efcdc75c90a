"""grpo-engine: native-PyTorch GRPO training for small reasoning models on one consumer GPU.

The public names below are imported on first use (PEP 562), so that `import grpo_engine.config` and
`grpo --help` do not pay for importing torch.
"""

from importlib import import_module

_PUBLIC = {
    "GRPO": ".api",
    "CheckpointError": ".model.hf_io",
    "load_model": ".model.loading",
    "save_model": ".model.loading",
    "Tokenizer": ".model.tokenizer",
    "load_tokenizer": ".model.loading",
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
