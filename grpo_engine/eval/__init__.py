"""Evaluation: pass@k, maj@k, format rate, lengths."""
