"""Reference implementations the tests compare the engine against (importable from any test: pyproject sets
pytest's pythonpath to tests/)."""

from pathlib import Path

import torch


def naive_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the entropy, through the full [N, V] logits (no chunking, no fusing)."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    z = (hidden @ weight.t()).to(dtype) / temperature  # [N, V]
    logp_all = torch.log_softmax(z, dim=-1)  # [N, V]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp_all.gather(1, targets.long()[:, None]).squeeze(1), ent


def rss_mib() -> float:
    """The process's resident set now (Linux /proc), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# Task options of the R1 style (think / answer tags) and of the byte-level tiny models, pinned by the tests
# that check those behaviours now that the built-in defaults are made for instruct models.
from grpo_engine.tasks import R1_PREFILL, R1_SYSTEM_PROMPT  # noqa: E402

R1 = dict(system_prompt=R1_SYSTEM_PROMPT, prefill=R1_PREFILL, format="strict", instruction="",
          extractors=("answer_tag", "boxed", "answer_is", "last_number"))
R1_COUNTDOWN = {**R1, "extractors": ("answer_tag",),
                "instruction": "Think in <think> </think> tags, then give only the equation in <answer> </answer> "
                               "tags, for example <answer>(1 + 2) * 3</answer>."}
BYTE_ARITHMETIC = dict(template="{a}{op}{b}=", instruction="", format="answer_tag", format_weight=0.1,
                       extractors=("answer_tag",))
