"""A second module of rewards for tests/api, one named as one of api_rewards' ("api_more_rewards:length")."""


def length(example, completion: str) -> float:
    """Half of api_rewards.length: two rewards of one name, told apart in the metrics by their values."""
    return len(completion) / 20
