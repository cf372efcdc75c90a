"""The training forward: the final hidden states that predict completion tokens, and their log-probs without a
graph (old / reference policy). No [B, T, V] logits: only completion positions reach the LM head.

Shared prompts: the forward runs each prompt ONCE per group, with gradients, instead of once per completion.

GRPO trains G completions of every prompt; in the plain forward each of the G rows recomputes its prompt,
which is most of the tokens when completions are short. Here a micro-batch is split into two passes:

    row i = prompt (length l) + completion (length n). The positions whose hidden states predict completion
    tokens are l-1 .. l+n-2: the prompt's last token and the completion's first n-1 tokens. So

    prompt pass      prompt[:-1] of each distinct prompt, [P, Lp] right-padded, plain causal attention; every
                     layer's keys/values are recorded (PromptKV);
    completion pass  prompt[-1:] + completion[:-1] of each row, [b, S] right-padded; at every layer its queries
                     attend to their prompt's recorded keys/values (index_select over rows, SharedPromptKV)
                     followed by their own, causally. Positions continue from the prompt's length.

Each query sees exactly the keys/values it sees in the plain forward, so log-probs and gradients are the same
up to float rounding; autograd sums the G rows' gradients into the one prompt pass. Only the completion pass's
hidden states are returned, in the plain forward's order (row-major over completion_mask[:, 1:]).

The two cache-like objects implement the model's KVCacheLike protocol (model/transformer.py); they are
training-side objects, the model knows nothing of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.transformer import rope_switch
from ..rl.logprobs import token_logprobs
from .batch import TrainBatch, plan_micro_batches


class PromptKV:
    """Prompt pass: records each layer's keys/values (with their autograd history) and attends to them."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers  # per layer [P, H_kv, Lp, D]
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.start = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Assigned by layer, not appended: activation checkpointing re-runs a block in backward.
        self.k[layer], self.v[layer] = k, v
        return k, v


class SharedPromptKV:
    """Completion pass: each row's prompt keys/values (slots [0, Lp)) followed by the row's own."""

    def __init__(self, prompt: PromptKV, prompt_of_row: torch.Tensor):
        self.k, self.v = list(prompt.k), list(prompt.v)  # per layer [P, H_kv, Lp, D]
        self.rows = prompt_of_row  # [b] long, which prompt each row continues
        self.start = self.k[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_prompt = self.k[layer].index_select(0, self.rows)  # [b, H_kv, Lp, D]; backward sums over rows
        v_prompt = self.v[layer].index_select(0, self.rows)
        return torch.cat([k_prompt, k], dim=2), torch.cat([v_prompt, v], dim=2)  # [b, H_kv, Lp + S, D]


@dataclass
class SharedLayout:
    """Index tensors of the two passes for one micro-batch (on the batch's device)."""

    prompt_ids: torch.Tensor  # [P, Lp] long, prompt[:-1] of each distinct prompt, right-padded (Lp may be 0)
    prompt_of_row: torch.Tensor  # [b] long, index into prompt_ids of each row's prompt
    suffix_ids: torch.Tensor  # [b, S] long, prompt[-1:] + completion[:-1], right-padded
    key_mask: torch.Tensor  # [b, Lp + S] bool, valid prompt slots then (all) suffix slots
    suffix_mask: torch.Tensor  # [b, S] bool, suffix positions that predict a trained completion token


def shared_layout(batch: TrainBatch) -> SharedLayout:
    """Where each row's prompt and suffix come from, computed with tensor ops on the batch's device."""
    ids, device = batch.input_ids, batch.input_ids.device  # [b, T]
    b, T = ids.shape
    distinct, prompt_of_row = torch.unique(batch.prompt_index, return_inverse=True)  # [P], [b]
    P = distinct.shape[0]
    first_row = torch.full((P,), b, dtype=torch.long, device=device).scatter_reduce(
        0, prompt_of_row, torch.arange(b, device=device), reduce="amin")  # [P]: any row holds the prompt
    prefix_len = batch.prompt_lengths - 1  # [b], tokens in the prompt pass (all but the prompt's last)
    suffix_len = batch.lengths - prefix_len - 1  # [b] = completion length
    Lp, S = int(prefix_len.max()), max(1, int(suffix_len.max()))
    j = torch.arange(S, device=device)  # [S]
    src = prefix_len[:, None] + j  # [b, S]: column of input_ids of each suffix position
    in_row = j[None, :] < suffix_len[:, None]  # [b, S]
    trained = batch.completion_mask[:, 1:].bool().gather(1, src.clamp(max=T - 2))  # [b, S]
    prompt_slots = torch.arange(Lp, device=device)[None, :] < prefix_len[:, None]  # [b, Lp]
    return SharedLayout(
        prompt_ids=ids[first_row, :Lp],
        prompt_of_row=prompt_of_row,
        suffix_ids=ids.gather(1, src.clamp(max=T - 1)),
        key_mask=torch.cat([prompt_slots, torch.ones(b, S, dtype=torch.bool, device=device)], dim=1),
        suffix_mask=trained & in_row,
    )


def shared_prompt_hidden(model, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """completion_hidden (train/update.py) with each prompt run once: (hidden [N, D], targets [N], mask [b, T-1]).

    Requires batch.prompt_index (rows with equal index have identical prompt tokens) and a completion_mask
    that is 0 on prompt tokens (build_train_batch makes both).
    """
    lay = shared_layout(batch)
    cache = None
    if lay.prompt_ids.shape[1] > 0:  # all prompts of one token: nothing before the suffix to share
        cache = PromptKV(len(model.layers))
        model(lay.prompt_ids, cache=cache, return_hidden=True)  # [P, Lp, D] unused: only keys/values matter
        cache = SharedPromptKV(cache, lay.prompt_of_row)
    hidden = model(lay.suffix_ids, lay.key_mask, cache=cache, return_hidden=True)  # [b, S, D]
    mask = batch.completion_mask[:, 1:].bool()  # [b, T-1]
    return hidden[lay.suffix_mask], batch.input_ids[:, 1:][mask], mask


# ----------------------------------------------------------------------------------------------------
# Completion hidden states and log-probs


def completion_hidden(model, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict completion tokens, and those tokens.

    Returns (hidden [N, D], targets [N], mask [b, T-1]); mask[i, t] marks that position t of row i predicts
    the completion token input_ids[i, t + 1], in the row-major order of hidden / targets. Rows that share a
    prompt (batch.prompt_index) run it once (train/forward.py); otherwise every row runs whole.
    """
    switch = rope_switch(model.config)
    passes = switch is not None and int(batch.lengths.max()) - 1 > switch
    if batch.prompt_index is not None and not passes:  # a prompt's keys cached before longrope's switch are stale
        return shared_prompt_hidden(model, batch)
    return plain_completion_hidden(model, batch)


def plain_completion_hidden(model, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """completion_hidden with every row's prompt + completion through the model (no sharing). A longrope model
    gets the rows' key mask, so that each row's factors follow its own length, not the padded batch's
    (model/transformer.py rope_row_inv_freq)."""
    ids = batch.input_ids[:, :-1]  # [b, T-1]
    key_mask = None
    if rope_switch(model.config) is not None:  # right padding: a row's real tokens are its first lengths - 1
        key_mask = torch.arange(ids.shape[1], device=ids.device) < (batch.lengths.to(ids.device) - 1)[:, None]
    hidden = model(ids, key_mask, return_hidden=True)  # [b, T-1, D]
    mask = batch.completion_mask[:, 1:].bool()  # [b, T-1]
    return hidden[mask], batch.input_ids[:, 1:][mask], mask


def scatter_completion(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values [N] at the True positions of mask [b, T-1] -> [b, T] (0 elsewhere; position t+1 <- mask[:, t])."""
    out = torch.zeros((mask.shape[0], mask.shape[1] + 1), dtype=values.dtype, device=values.device)  # [b, T]
    out[:, 1:][mask] = values
    return out


def sequence_logprobs(model, batch: TrainBatch, *, temperature: float, chunk_size: int,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each completion token under `model`: [b, T] (0 off the completion), entropy likewise.

    Only completion positions go through the LM head (chunked), never the [b, T, V] logits of the prompt.
    """
    hidden, targets, mask = completion_hidden(model, batch)  # [N, D], [N], [b, T-1]
    logp, ent = token_logprobs(hidden, model.lm_head.weight, targets, temperature=temperature,
                               chunk_size=chunk_size, with_entropy=with_entropy, gemm=model.kernels.head,
                               softcap=model.config.final_logit_softcapping)  # [N], [N] | None
    return scatter_completion(logp, mask), None if ent is None else scatter_completion(ent, mask)


@torch.no_grad()
def batch_logprobs(model, batch: TrainBatch, token_budget: int, *, temperature: float,
                   chunk_size: int) -> torch.Tensor:
    """[B, T] log-probs of all rows, micro-batch by micro-batch, in eval mode (old / reference policy). Gathered on
    the model's device and copied to the host once, so a GPU does not wait for the host after every micro-batch."""
    out = torch.zeros(batch.input_ids.shape, device=model.device)  # [B, T]
    was_training = model.training
    model.eval()  # no (LoRA) dropout: these are the log-probs of the policy itself
    try:
        for rows in plan_micro_batches(batch, token_budget):
            idx = torch.tensor(rows)
            sub = batch.select(idx).to(model.device)
            logp, _ = sequence_logprobs(model, sub, temperature=temperature, chunk_size=chunk_size)
            out[idx.to(out.device), : logp.shape[1]] = logp.float()
    finally:
        model.train(was_training)
    return out.cpu()
