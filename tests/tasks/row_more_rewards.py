"""A reward of tests/tasks/test_reward_rows.py named as one of row_rewards' ("row_more_rewards:length")."""


def length(example, completion: str) -> float:
    """Half of row_rewards.length."""
    return len(completion) / 2
