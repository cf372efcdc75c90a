"""Activation checkpointing applied to a model from outside: every k-th block recomputes its activations in
backward instead of keeping them (memory.activation_checkpointing).

The transform replaces each chosen block by a CheckpointedBlock holding the block's own submodules (and a
checkpointed block that is no longer chosen by a plain Block holding them), so parameters, their names, state
dicts, deep copies (the reference policy) and LoRA wrapping are unchanged; it acts only in training mode with
gradients enabled, so rollout and scoring pay nothing for it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model.transformer import Block, Transformer


class CheckpointedBlock(Block):
    """A Block whose forward is recomputed in backward (non-reentrant torch.utils.checkpoint)."""

    def forward(self, *args):
        if self.training and torch.is_grad_enabled():
            return checkpoint(super().forward, *args, use_reentrant=False)
        return super().forward(*args)


def apply_activation_checkpointing(model: Transformer, every: int) -> Transformer:
    """Checkpoint block i when every > 0 and i % every == 0; every = 0 turns it off. Returns the model."""
    assert every >= 0, every
    for i, block in enumerate(model.layers):
        kind = CheckpointedBlock if every and i % every == 0 else Block
        if type(block) is not kind:
            model.layers[i] = block_holding(block, kind)
    return model


def block_holding(block: Block, kind: type[Block]) -> Block:
    """A `kind` block holding `block`'s own submodules (norms, attention, MLP: the same parameters, nothing
    copied) and its family's settings (norm placement, residual multiplier), in its train / eval mode."""
    new = kind.__new__(kind)
    nn.Module.__init__(new)
    new.__dict__.update({k: v for k, v in block.__dict__.items() if not k.startswith("_") and k != "training"})
    for name, child in block.named_children():
        setattr(new, name, child)
    return new.train(block.training)


def checkpointed_blocks(model: nn.Module) -> list[int]:
    """Indices of the blocks that recompute their activations in backward."""
    return [i for i, block in enumerate(model.layers) if isinstance(block, CheckpointedBlock)]
