"""Rollout: sample G completions per prompt with the policy's own weights (KV cache, shared prefill)."""

from .generate import GenerationOutput, generate
from .kv_cache import KVCache
from .sampling import SamplingParams

__all__ = ["GenerationOutput", "KVCache", "SamplingParams", "generate"]
