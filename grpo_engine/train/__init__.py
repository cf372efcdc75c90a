"""Training: the loop and what it composes (batching, memory, optimizers, reference, checkpoints)."""
