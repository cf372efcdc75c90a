"""The curriculum section: which prompts the stream serves next, decided by scoring a pool of them with the policy.

Every `every` steps the trainer draws `pool_size` prompts, samples `samples` completions of each with the
policy's own sampler and scores them (accuracy, semantic entropy); `mode` then decides which of the pooled
prompts are served first and in what order (collect/curriculum.py). The cost is pool_size x samples extra
completions every `every` steps, which is why the section is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import one_of, option, require

CURRICULUM_MODES = ("none", "semantic_entropy", "accuracy_band")


@dataclass(frozen=True)
class CurriculumSection:
    mode: str = option("none", "none: the plain shuffled stream | semantic_entropy: serve each scored pool easy -> "
                               "hard by difficulty, then return to the stream | accuracy_band: serve only the pooled "
                               "prompts whose accuracy lies in [band_low, band_high]", CURRICULUM_MODES)
    every: int = option(10, "steps between re-scorings (the first is at step 1)")
    pool_size: int = option(32, "prompts scored per re-scoring (prompts still queued from the last pool count)")
    samples: int = option(4, "completions sampled per pooled prompt to score it (>= 2: entropy compares answers)")
    max_new_tokens: int = option(0, "completion cap while scoring; 0 = rollout.max_new_tokens")
    entropy_weight: float = option(0.5, "semantic_entropy: difficulty = w x entropy / log(samples) + (1 - w) x "
                                        "(1 - accuracy); 0 ranks by accuracy alone, 1 by entropy alone")
    band_low: float = option(0.1, "accuracy_band: lowest pooled accuracy kept (below: too hard, no reward yet)")
    band_high: float = option(0.9, "accuracy_band: highest pooled accuracy kept (above: already solved)")

    def __post_init__(self) -> None:
        one_of("curriculum.mode", self.mode, CURRICULUM_MODES)
        require(self.every >= 1, f"curriculum.every={self.every} must be >= 1")
        require(self.pool_size >= 1, f"curriculum.pool_size={self.pool_size} must be >= 1")
        require(self.samples >= 2, f"curriculum.samples={self.samples} must be >= 2: semantic entropy and accuracy "
                                   "compare several answers to one prompt")
        require(self.max_new_tokens >= 0, f"curriculum.max_new_tokens={self.max_new_tokens} must be >= 0 "
                                          "(0 = rollout.max_new_tokens)")
        require(0.0 <= self.entropy_weight <= 1.0, f"curriculum.entropy_weight={self.entropy_weight} must be in "
                                                   "[0, 1]")
        require(0.0 <= self.band_low <= self.band_high <= 1.0,
                f"curriculum.band_low={self.band_low}, band_high={self.band_high}: need 0 <= band_low <= band_high "
                "<= 1")
