"""RL math as pure functions: log-probs, advantages, losses, semantic entropy, overlong and group filtering.

Formulas, citations and the config values that select each variant: docs/algorithms.md.
"""

from .advantages import compute_advantages
from .logprobs import token_logprobs
from .losses import policy_loss

__all__ = ["compute_advantages", "policy_loss", "token_logprobs"]
