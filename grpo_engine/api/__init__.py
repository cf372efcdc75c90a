"""The Python API: `GRPO`, the trainer object (api/trainer.py; docs/python.md)."""

from .trainer import GRPO

__all__ = ["GRPO"]
