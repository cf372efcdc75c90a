"""grpo-engine: native-PyTorch GRPO training for small reasoning models on one consumer GPU."""

from .model.hf_io import CheckpointError, load_model, save_model
from .model.tokenizer import Tokenizer, load_tokenizer
from .rollout import GenerationOutput, SamplingParams, generate

__all__ = [
    "CheckpointError",
    "GenerationOutput",
    "SamplingParams",
    "Tokenizer",
    "generate",
    "load_model",
    "load_tokenizer",
    "save_model",
]
__version__ = "0.1.0"
