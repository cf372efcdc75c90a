"""Preallocated key/value cache for rollout.

The model hands each forward's keys/values to `update`, which writes them into these buffers at `start`
(see KVCacheLike in model/transformer.py), so decoding never reallocates or concatenates per step. Rows
are the sequences in flight; `select_rows` gathers a subset of rows, which is how a prefilled prompt is
shared by its G samples (index = repeat_interleave) and how finished rows leave the batch (compaction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.transformer import ModelConfig


@dataclass
class KVCache:
    """Per-layer buffers k[l], v[l]: [B, H_kv, S_max, D]; slots [0, start) are written."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    start: int = 0

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        layers = range(cfg.num_hidden_layers)
        return cls(
            k=[torch.empty(shape, dtype=dtype, device=device) for _ in layers],
            v=[torch.empty(shape, dtype=dtype, device=device) for _ in layers],
        )

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H_kv, T, D] at slots [start, start + T) of `layer`; return slots [0, start + T)."""
        end = self.start + k.shape[2]
        self.k[layer][:, :, self.start : end] = k
        self.v[layer][:, :, self.start : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # [B, H_kv, start + T, D]

    def copy_prefix_from(self, other: KVCache, rows: torch.Tensor) -> None:
        """Fill slots [0, other.start) of every row r with row rows[r] of `other`; rows: [B] long.

        This is the prompt sharing step: `other` holds the P prefilled prompts, `rows` repeats each of
        them G times, and the G samples then decode from their own copy of the prompt's keys/values.
        """
        n = other.start
        for dst, src in zip((*self.k, *self.v), (*other.k, *other.v)):
            dst[:, :, :n] = src[:, :, :n].index_select(0, rows)  # [B, H_kv, n, D]
        self.start = n

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` ([B'] long, in that order): drops finished rows from the batch."""
        end = self.start
        for buffers in (self.k, self.v):
            for i, t in enumerate(buffers):
                kept = torch.empty((len(rows), *t.shape[1:]), dtype=t.dtype, device=t.device)
                kept[:, :, :end] = t[:, :, :end].index_select(0, rows)  # only the written slots
                buffers[i] = kept
