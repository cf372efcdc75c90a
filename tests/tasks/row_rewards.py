"""Reward functions of tests/tasks/test_reward_rows.py, imported by name ("row_rewards:<name>")."""


def by_difficulty(example, completion: str) -> float:
    """The row's own `difficulty` column, as a reward sees it."""
    return float(example["difficulty"]) + (completion == example["answer"])


def length(example, completion: str) -> float:
    return float(len(completion))
