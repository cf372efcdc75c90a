"""grpo-engine: native-PyTorch GRPO training for small reasoning models on one consumer GPU."""

from .model.hf_io import CheckpointError, load_model, save_model
from .model.tokenizer import Tokenizer, load_tokenizer

__all__ = ["CheckpointError", "Tokenizer", "load_model", "load_tokenizer", "save_model"]
__version__ = "0.1.0"
