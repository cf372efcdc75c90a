"""Training: the loop and what it composes (batching, memory knobs, optimizers, reference, checkpoints, planner)."""
