"""Reward functions for trainer tests, imported by the custom task as "reward_fns:<name>".

A random tiny model rarely earns a task reward, so every group would have zero variance and no update
would happen; these rewards vary between completions so the advantages (and the updates) are non-zero.
"""


def even_bytes(example, completion: str) -> float:
    """Fraction of characters with an even code point: differs between random completions."""
    return sum(ord(c) % 2 == 0 for c in completion) / max(1, len(completion))
