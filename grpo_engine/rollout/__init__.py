"""Rollout: sample G completions per prompt with the policy's own weights (one decode loop over one decode cache,
shared prefill)."""

from .generate import GenerationOutput, generate
from .sampling import SamplingParams
from .static_cache import StaticDecodeState

__all__ = ["GenerationOutput", "SamplingParams", "StaticDecodeState", "generate"]
