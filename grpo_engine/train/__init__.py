"""Training: the loop, micro-batching, optimizers, reference policy, memory options, checkpoints."""
