"""What every decode starts from: the random draws of its rows and the prefill of its prompts into the decode cache.

generate.generate_rows sets a call up (rows, waves, these draws) and runs static_decode.decode_static, the one
decode loop, wave by wave; its first step is `prefill_prompts`: each distinct prompt once, written into the rows
[:P] of the decode cache (static_cache.StaticDecodeState), a prefix all prompts share run once.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ..model.transformer import Transformer, rope_switch, soft_cap
from .static_cache import StaticDecodeState


def as_seed(seed: int | Sequence[int]) -> int | list[int]:
    """One seed as a Python int (numpy's integers included: `isinstance(np.int64(3), int)` is False,
    so such a seed would be taken for a sequence and fail with "has no len()"), or the per-prompt seeds as a list."""
    return int(seed) if isinstance(seed, numbers.Integral) else [int(s) for s in seed]


class Draws:
    """The one random stream of every decode: one shared generator, or one generator per prompt (per trajectory),
    drawn ahead as a table of uniforms per wave."""

    def __init__(self, seed: int | Sequence[int], device: torch.device):
        per_prompt = not isinstance(seed, int)
        self.shared = None if per_prompt else torch.Generator(device=device).manual_seed(seed)
        self.prompts = [torch.Generator(device=device).manual_seed(int(s)) for s in seed] if per_prompt else None
        self.device = device

    def table(self, prompt_of_row: list[int], steps: int) -> torch.Tensor:
        """[R, steps] uniforms drawn ahead (column t draws a row's t-th token): a prompt's rows take one
        [rows, steps] block from its own generator (prompts in order of first appearance), or all rows one block
        from the shared one. A row's draws then depend on neither its batch-mates nor when any row finishes."""
        if self.prompts is None:
            return torch.rand((len(prompt_of_row), steps), generator=self.shared, device=self.device)
        rows: dict[int, list[int]] = {}
        for a, p in enumerate(prompt_of_row):
            rows.setdefault(p, []).append(a)
        u = torch.empty(len(prompt_of_row), steps, device=self.device)
        for p, idx in rows.items():
            u[idx] = torch.rand((len(idx), steps), generator=self.prompts[p], device=self.device)
        return u


# ----------------------------------------------------------------------------------------------------
# Prefill: each distinct prompt once, its keys/values shared with its rows


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [P, L] (pad id 0, never attended) and mask [P, L] bool (True = real token). Built from Python lists
    in one tensor each (the prefill's prompts, a trajectory's environment tokens)."""
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[False] * (L - len(p)) + [True] * len(p) for p in prompts], dtype=torch.bool)
    return ids.to(device), mask.to(device)


MIN_SHARED_PREFIX = 8  # tokens: a shorter common prefix is not worth its own forward call


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens at the start of every prompt (a chat template's system prompt and turn header), leaving each prompt
    at least one token of its own; 0 for a single prompt."""
    if len(prompts) < 2:
        return 0
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    c = 0
    while c < limit and all(p[c] == first[c] for p in prompts):
        c += 1
    return c


def prefill_prompts(model: Transformer, state: StaticDecodeState, prompts: list[list[int]]):
    """The P prompts' keys/values written into rows [:P] of the decode cache, slots [0, L) ->
    (key mask [P, L] (True = real token), last-position logits [P, V]).

    A prefix that every prompt shares (shared_prefix_length >= MIN_SHARED_PREFIX) runs once, in row 0: its c slots
    are copied to the other rows, the rest of each prompt is left-padded after them ([prefix][pad][own tokens]) and
    attends to them. Positions count valid slots, so every token keeps its position; the keys/values equal those of
    the plain prefill up to float rounding. A system prompt is often most of a chat prompt.
    """
    device = model.device
    c = shared_prefix_length(prompts)
    switch = rope_switch(model.config)
    if switch is not None and max(len(p) for p in prompts) > switch:
        c = 0  # longrope: a prompt past the original context rotates all its positions by the long factors
    c = c if c >= MIN_SHARED_PREFIX else 0  # 0: the plain prefill
    ids, mask = left_pad([p[c:] for p in prompts], device)  # [P, L - c]
    P = ids.shape[0]
    if c:
        model(torch.tensor([prompts[0][:c]], device=device), torch.ones(1, c, dtype=torch.bool, device=device),
              cache=state.prompts(1), return_hidden=True)  # [1, c] into row 0
        state.share_prefix(P, c)
        mask = torch.cat([torch.ones(P, c, dtype=torch.bool, device=device), mask], dim=1)  # [P, L]
    hidden = model(ids, mask, cache=state.prompts(P, start=c), return_hidden=True)  # [P, L - c, hidden]
    logits = soft_cap(model.lm_head(hidden[:, -1]), model.config.final_logit_softcapping)  # [P, V]
    return mask, logits  # the LM head at the last position only
