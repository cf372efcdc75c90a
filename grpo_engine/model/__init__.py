"""Model: one transformer file, HF checkpoint I/O, tokenizer, tiny checkpoints."""
