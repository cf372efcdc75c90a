"""Rewards of tests/api, importable by name ("api_rewards:<name>") as a YAML config names them."""

import time


def even_bytes(example, completion: str) -> float:
    """Fraction of characters with an even code point: differs between a random model's replies (a signal)."""
    return sum(ord(c) % 2 == 0 for c in completion) / max(1, len(completion))


def length(example, completion: str) -> float:
    return len(completion) / 10


def by_level(example, completion: str) -> float:
    """Reads a column the task does not know: the row's `level`."""
    return even_bytes(example, completion) + example["level"]


def raises(example, completion: str) -> float:
    raise RuntimeError("the verifier crashed")


def hangs(example, completion: str) -> float:
    time.sleep(30)
    return 1.0
