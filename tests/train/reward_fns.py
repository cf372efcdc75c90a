"""Reward functions for trainer tests, imported by the custom task as "reward_fns:<name>".

A random tiny model rarely earns a task reward, so every group would have zero variance and no update
would happen; these rewards vary between completions so the advantages (and the updates) are non-zero.
"""


def even_bytes(example, completion: str) -> float:
    """Fraction of characters with an even code point: differs between random completions."""
    return sum(ord(c) % 2 == 0 for c in completion) / max(1, len(completion))


def raises(example, completion: str) -> float:
    raise RuntimeError("the verifier crashed")


def returns_nan(example, completion: str) -> float:
    return float("nan")


def returns_text(example, completion: str):
    return "1.0"


def returns_none(example, completion: str):
    return None


def sleeps(example, completion: str) -> float:
    import time

    time.sleep(1.0)
    return 1.0


def huge(example, completion: str) -> float:
    return 1e308


def first_char(example, completion: str):
    """The completion's first character is its "answer", correct when its code point is even: answers and
    accuracy differ between prompts of a random model (the curriculum's scores have something to rank)."""
    from grpo_engine.tasks.base import RewardResult

    answer = completion[:1] or None
    correct = float(answer is not None and ord(answer) % 2 == 0)
    return RewardResult(correct, {"answer": correct}, answer)


_calls = {"n": 0}


def sigterm_rank_1_in_step_2(example, completion: str) -> float:
    """even_bytes; on rank 1 of a `--nproc 2` run with 2 prompts x 4 completions per rank, the first reward of
    step 2 sends SIGTERM to its own process (a stop request that reaches one rank only)."""
    import os
    import signal

    _calls["n"] += 1
    if os.environ.get("RANK") == "1" and _calls["n"] == 9:
        os.kill(os.getpid(), signal.SIGTERM)
    return even_bytes(example, completion)


def rare_checksum(example, completion: str):
    """Correct for about one completion in eight (a checksum of its text): small groups seldom have a spread, larger
    ones more often (check.fit_group_size has a reason to grow them)."""
    import zlib

    from grpo_engine.tasks.base import RewardResult

    correct = float(zlib.crc32(completion.encode()) % 8 == 0)
    return RewardResult(correct, {"answer": correct}, completion[:1] or None)
