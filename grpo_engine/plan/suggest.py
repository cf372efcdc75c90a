"""What to change when a step does not fit: each candidate is a named change of the planner's knobs, re-planned;
and the plan as text (`grpo plan`)."""

from __future__ import annotations

from dataclasses import replace

from .decode_state import holds, kv_state_bytes
from .memory import (
    DTYPE_BYTES,
    GIB,
    MemoryPlan,
    PlanInput,
    fits,
    kv_cache_bytes,
    plan_memory,
    resolve_checkpointing,
    rollout_rows,
)


def _halve_micro_batch(k: PlanInput) -> PlanInput | None:
    return replace(k, micro_batch_rows=k.micro_batch_rows // 2) if k.micro_batch_rows > 1 else None


def _halve_rows_in_flight(k: PlanInput) -> PlanInput | None:
    """Half the rows, and the rollout.max_tokens_in_flight that decodes them (the static decode's waves follow it)."""
    rows = rollout_rows(k)
    budget = rows // 2 * (k.prompt_len + k.completion_len)
    return replace(k, rollout_rows_in_flight=rows // 2, max_tokens_in_flight=budget) if rows > 1 else None


def _eval_as_many_as_the_rollout(k: PlanInput) -> PlanInput | None:
    """The evaluations decode one row per example at once: no more than the rollout's rows runs them on the rollout's
    static decode state, with no state of their own beside it during eval."""
    rows = k.prompts_per_step * k.group_size
    return replace(k, eval_examples=rows) if k.eval_examples > rows and k.static_decode else None


CHANGES = {
    "enable activation checkpointing on every block (memory.activation_checkpointing=all)":
        lambda k: replace(k, activation_checkpointing="all") if k.activation_checkpointing != "all" else None,
    "train LoRA adapters instead of all weights (lora.enabled=true)":
        lambda k: replace(k, mode="lora", reference="adapters" if k.reference != "none" else "none")
        if k.mode == "full" else None,
    "QLoRA: NF4 base weights (lora.enabled=true, lora.quantize_base=nf4)":
        lambda k: replace(k, mode="qlora", reference="adapters" if k.reference != "none" else "none")
        if k.mode != "qlora" else None,
    "offload AdamW state to CPU (optimizer.name=adamw_offload)":
        lambda k: replace(k, optimizer="adamw_offload") if k.optimizer != "adamw_offload" else None,
    "8-bit AdamW state (optimizer.name=adamw_8bit)":
        lambda k: replace(k, optimizer="adamw_8bit") if k.optimizer not in ("adamw_8bit", "adamw_offload")
        else None,
    "bf16 weights (memory.precision=bf16)":
        lambda k: replace(k, precision="bf16") if k.precision == "fp32" else None,
    "halve the training micro-batch (memory.micro_batch_tokens / 2)": _halve_micro_batch,
    "decode fewer rows at once (rollout.max_tokens_in_flight)": _halve_rows_in_flight,
    "evaluate as many examples as the rollout has rows (eval.max_examples = P x G)": _eval_as_many_as_the_rollout,
    "smaller log-prob chunks (memory.logprob_chunk_size=256)":
        lambda k: replace(k, logprob_chunk=256) if k.logprob_chunk > 256 else None,
    "keep the reference model on the CPU (reference.park_on_cpu=true)":
        lambda k: replace(k, reference="cpu") if k.reference == "gpu_copy" else None,
}


METHOD_CHANGES = {text for text in CHANGES if "LoRA" in text}  # these change what is trained


def _greedy(
    plan: MemoryPlan, card_gib: float, allowed: list[str], max_steps: int
) -> tuple[list[str], MemoryPlan]:
    """Repeatedly apply the allowed change that lowers the total most, until it fits or nothing helps."""
    recipe, current = [], plan
    for _ in range(max_steps):
        options = [(plan_memory(plan.model, ch), text) for text in allowed
                   if text not in recipe and (ch := CHANGES[text](current.knobs)) is not None]
        if not options:
            break
        best, text = min(options, key=lambda o: o[0].total_gib)
        if best.total_gib >= current.total_gib - 0.01:
            break
        recipe.append(text)
        current = best
        if fits(current, card_gib):
            break
    return recipe, current


def suggest(plan: MemoryPlan, card_gib: float, max_steps: int = 6) -> list[str]:
    """Concrete changes, each with its predicted effect; then, if the plan does not fit, a greedy recipe
    that keeps the training method (full / LoRA) when it can, and changes it only when it must."""
    lines = []
    for text, change in CHANGES.items():
        new_knobs = change(plan.knobs)
        if new_knobs is None:
            continue
        new = plan_memory(plan.model, new_knobs)
        if plan.total_gib - new.total_gib > 0.01:
            tag = "fits" if fits(new, card_gib) else "still over"
            lines.append(f"{text}: {plan.total_gib:.1f} -> {new.total_gib:.1f} GiB ({tag} {card_gib:g} GiB)")
    if fits(plan, card_gib):
        return lines
    same_method = [t for t in CHANGES if t not in METHOD_CHANGES]
    recipe, current = _greedy(plan, card_gib, same_method, max_steps)
    if not fits(current, card_gib):
        recipe, current = _greedy(plan, card_gib, list(CHANGES), max_steps)
    verdict = "fits" if fits(current, card_gib) else "still does not fit"
    if recipe:
        lines.append(f"to fit {card_gib:g} GiB, combine: " + "; then ".join(recipe)
                     + f" -> {current.total_gib:.1f} GiB ({verdict})")
    return lines


def window_lines(plan: MemoryPlan) -> list[str]:
    """A windowed model's KV: the sliding layers, what the decode cache keeps of them (the kept static state's, else
    the rollout's cache) and what a full cache would hold."""
    cfg, k, d = plan.model, plan.knobs, plan.decode
    if not cfg.windowed:
        return []
    from ..rollout.static_cache import CHUNK

    sliding = sum(cfg.window(i) is not None for i in range(cfg.num_hidden_layers))
    if d is not None:
        kept, full = (kv_state_bytes(cfg, d.shape.rows, d.shape.slots + 1, DTYPE_BYTES[k.precision], rings)
                      for rings in (True, False))
    else:
        kept, full = kv_cache_bytes(cfg, k), kv_cache_bytes(cfg, k, full=True)
    head = f"  sliding window: {sliding} of {cfg.num_hidden_layers} layers see the last {cfg.sliding_window} positions"
    if kept == full:
        return [f"{head}, more than a row's slots: the rollout's KV cache holds every slot, {full / GIB:.2f} GiB"]
    return [f"{head} and keep at most {cfg.sliding_window + CHUNK} slots a row (the window + {CHUNK}); the rollout's "
            f"KV cache holds {kept / GIB:.2f} GiB, a full cache would hold {full / GIB:.2f} GiB: "
            f"{(full - kept) / GIB:.2f} GiB less"]


def decode_lines(plan: MemoryPlan) -> list[str]:
    """The static decode's kept state: its size and the calls it runs; and the state of an evaluation it cannot hold,
    alive during eval only (docs/memory.md)."""
    d = plan.decode
    if d is None:
        return []
    calls = ", ".join(f"{c.name} {c.rows} rows x {c.slots} slots" for c in d.calls if holds(d.shape, c))
    lines = [f"  static decode state kept: {d.shape.rows} rows x {d.shape.slots} slots (+1 scratch), "
             f"{sum(d.state.values()) / GIB:.2f} GiB + graphs' pool {d.pool / GIB:.2f} GiB; sized by the largest "
             f"call it runs ({calls})"]
    if d.eval_shape is not None:
        lines.append(f"  the evaluation's larger call decodes on its own state, {d.eval_shape.rows} rows x "
                     f"{d.eval_shape.slots} slots: {d.releasable_after_eval / GIB:.2f} GiB during eval, freed after it")
    return lines


def format_plan(plan: MemoryPlan, card_gib: float | None = None) -> str:
    k = plan.knobs
    ckpt = k.activation_checkpointing
    if ckpt == "auto":
        ckpt = f"auto -> {resolve_checkpointing(plan.model, k, k.micro_batch_rows * (k.prompt_len + k.completion_len))}"
    head = (f"model: {plan.n_params / 1e9:.2f}B params, {plan.n_trainable / 1e6:.1f}M trainable ({k.mode}, "
            f"{k.precision}, {k.optimizer}, checkpointing={ckpt}); "
            f"P={k.prompts_per_step} G={k.group_size} prompt={k.prompt_len} completion={k.completion_len} "
            f"micro_batch_rows={k.micro_batch_rows}")
    lines = [head]
    for ph in plan.phases:
        mark = "  <- peak" if ph.name == plan.peak_phase else ""
        lines.append(f"  {ph.name:<10} {ph.total / GIB:7.2f} GiB{mark}")
        lines += [f"      {name:<32} {b / GIB:7.2f} GiB" for name, b in ph.components.items() if b > 0]
    lines += decode_lines(plan) + window_lines(plan)
    lines.append(f"  predicted peak: {plan.peak_bytes / GIB:.2f} GiB + {k.fragmentation:.0%} fragmentation + "
                 f"{k.cuda_context_gib:g} GiB CUDA context = {plan.total_gib:.2f} GiB")
    if card_gib is not None:
        lines.append(f"  {'FITS' if fits(plan, card_gib) else 'DOES NOT FIT'} a {card_gib:g} GiB card")
        lines += [f"  - {s}" for s in suggest(plan, card_gib)]
    return "\n".join(lines)
