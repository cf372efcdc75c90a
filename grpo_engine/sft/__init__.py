"""The supervised warm start: a short SFT phase (a tiny model from scratch, or a real one) before GRPO."""
