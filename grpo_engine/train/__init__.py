"""Training: the loop, batching, memory knobs, optimizers, the memory planner."""
