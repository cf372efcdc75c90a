"""Warm start: optionally build a tiny random base model, then a supervised phase, before GRPO.

Both stages write ordinary HF checkpoint directories under run_dir (base/ and sft/) and are skipped when
their directory is already complete, so a resumed run does not redo them and `grpo train` on the demo
config behaves the same as `grpo demo`. The policy that GRPO starts from is the last stage's directory.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

from ..checkpoint.run_dir import utc_stamp
from ..collect.tool_groups import first_prompt_text, rollout_tokenizer
from ..config import Config, ConfigError
from ..config.tools import ToolsSection
from ..model.loading import load_model, load_tokenizer, pick_device, save_model
from ..model.tiny import make_tiny_checkpoint
from ..progress import Progress
from ..rollout import SamplingParams, generate
from ..rollout.chat_turns import conversation_ids_and_mask
from ..tasks import render_prompt
from .trainer import train_sft

DONE_MARKER = ".complete"


def _complete(path: Path, settings: dict) -> bool:
    """The stage's directory is complete and was built with these settings (a mismatch is an error: the
    directory holds a different run's warm start, and it is not ours to delete)."""
    marker = path / DONE_MARKER
    if not marker.exists():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except json.JSONDecodeError:
        recorded = None  # written by an earlier version ("ok"): settings unknown
    if recorded is not None and recorded != settings:
        changed = sorted(k for k in settings.keys() | recorded.keys() if settings.get(k) != recorded.get(k))
        raise ConfigError(f"{path} was built with other warm-start settings ({', '.join(changed)}): start over with "
                          f"--overwrite (the old run is renamed) or choose another run_dir")
    return True


def _mark_complete(tmp: Path, final: Path, settings: dict) -> None:
    """Publish a finished stage. A `final` folder already there has no marker (_complete said so), so this code
    did not write it (its own folders get the marker before the rename): it is moved aside, never deleted."""
    (tmp / DONE_MARKER).write_text(json.dumps(settings, sort_keys=True) + "\n")
    if final.exists():
        aside = final.with_name(f"{final.name}.prev-{utc_stamp()}")
        final.rename(aside)
        print(f"warm start: {final} was not a finished {final.name} stage; it is now {aside} (nothing deleted)",
              file=sys.stderr, flush=True)
    tmp.rename(final)


# SFT settings added later: left out of a stage's recorded settings while they have their default, so the warm
# starts recorded before them still match
LATER_SFT_SETTINGS = {"examples": 0, "own_answers": False, "top_layers": 0}


def _settings(cfg: Config, stage: str) -> dict:
    """What a stage's result depends on, JSON-comparable."""
    tiny = dataclasses.asdict(cfg.warm_start.tiny)
    if stage == "base":
        return {"tiny": tiny}
    sft = {k: v for k, v in dataclasses.asdict(cfg.warm_start.sft).items()
           if k not in LATER_SFT_SETTINGS or LATER_SFT_SETTINGS[k] != v}
    declared = cfg.tools.enabled and cfg.tools.format != "undeclared"  # the tools are in its prompts
    tools = {"tools": [cfg.tools.format, list(cfg.tools.names)]} if declared else {}
    return {**tools, "tiny": tiny, "sft": sft, "task": cfg.task.name,
            "options": json.loads(json.dumps(dict(cfg.task.options), default=list)),
            "data_path": cfg.task.data_path, "model": "" if cfg.warm_start.tiny.arch else cfg.model.path}


def build_tiny_base(cfg: Config) -> Path:
    """run_dir/base: a random tiny checkpoint of the configured family (written once)."""
    t = cfg.warm_start.tiny
    out = Path(cfg.run_dir) / "base"
    if not _complete(out, _settings(cfg, "base")):
        tmp = out.with_name("base.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_checkpoint(tmp, t.arch, seed=t.seed, **t.shape())
        _mark_complete(tmp, out, _settings(cfg, "base"))
    return out


def sft_pairs(task, tokenizer, examples, tools: ToolsSection | None = None) -> list[tuple]:
    """(prompt ids, reference completion ids + EOS) for every example the task can complete; examples without
    a reference (e.g. loaded Countdown rows with no known solution) are left out. A task's
    `reference_conversation` (a teacher that calls tools) takes precedence: the completion is the whole
    conversation as a tool rollout would tokenize it, with a third element, the per-token target flags: the
    tool's responses (and turn markers) are context, not targets, as in the rollout's loss mask. Learning to
    predict a product the tool computed only teaches a tiny model to guess it, which delays the copy of the
    result into the answer (docs/tools.md). tools: when enabled, every prompt is the rollout's first prompt with
    the tool declarations (collect/tool_groups.py first_prompt_text), and the teacher's tool turns are rendered
    as the rollout renders them: the warm start sees the tokens GRPO will sample after."""
    reference = getattr(task, "reference_completion", None)
    if reference is None:
        raise ConfigError(
            f"task {task.name!r} gives no reference completions for the supervised warm start; "
            f"set warm_start.sft.steps=0"
        )
    eos = tokenizer.eos_token_ids[0]
    conversation = getattr(task, "reference_conversation", lambda ex: None)  # a teacher that calls tools
    with_tools = tools is not None and tools.enabled
    turns_tok = rollout_tokenizer(tokenizer, tools) if with_tools else tokenizer

    def target(ex) -> tuple[list[int], list[bool]] | None:
        turns = conversation(ex)
        if turns is not None:
            return conversation_ids_and_mask(turns_tok, turns)
        text = reference(ex)
        return None if text is None else (tokenizer.encode(text), [])

    pairs = []
    for ex in examples:
        found = target(ex)
        if found is None:
            continue
        ids, own = found
        text = first_prompt_text(tokenizer, task, ex, tools) if with_tools else render_prompt(task, tokenizer, ex)
        prompt = tokenizer.encode(text)
        # a tool's response in the teacher's conversation is context, never a target (as in a rollout's loss)
        pairs.append((prompt, ids + [eos], own + [True]) if own else (prompt, ids + [eos]))
    if not pairs:
        raise ConfigError(f"task {task.name!r} has no reference completion for any training example (e.g. data "
                          f"without solutions): the supervised warm start has nothing to learn; set "
                          f"warm_start.sft.steps=0")
    return pairs


def own_answers(model, tokenizer, pairs: list[tuple], max_new_tokens: int) -> list[tuple]:
    """Pairs whose target the teacher answered without a tool (no per-token flags) get the model's own greedy reply
    to the same prompt instead (its stop token included when it stopped; a reply cut at max_new_tokens stays cut):
    supervised on them, the model keeps its own habits there, and only the teacher's tool calls are new to it."""
    mine = [i for i, pair in enumerate(pairs) if len(pair) == 2]
    if not mine:
        return pairs
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tokenizer.eos_token_ids)
    was_training = model.training
    model.eval()
    try:
        out = generate(model, [pairs[i][0] for i in mine], params, seed=0, tokenizer=tokenizer)
    finally:
        model.train(was_training)
    replies = dict(zip(mine, out.completion_ids))
    return [(pair[0], list(replies[i])) if i in replies else pair for i, pair in enumerate(pairs)]


def train_only_top(model, top_layers: int) -> None:
    """top_layers > 0: every weight but the last `top_layers` blocks' and the final norm's stops taking gradients
    (the optimizer skips weights without one); the tied embedding / LM head among them. 0: all train."""
    if top_layers <= 0:
        return
    if top_layers > len(model.layers):
        raise ConfigError(f"warm_start.sft.top_layers={top_layers} but the model has {len(model.layers)} blocks")
    trained = {id(p) for block in model.layers[-top_layers:] for p in block.parameters()}
    trained |= {id(p) for p in model.norm.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trained)


def run_sft(cfg: Config, base: Path, task) -> Path:
    """run_dir/sft: `base` after the supervised phase on the task's training split (written once)."""
    out = Path(cfg.run_dir) / "sft"
    if _complete(out, _settings(cfg, "sft")):
        return out
    model = load_model(base, device=pick_device(cfg.model.device))  # model.device, as GRPO (auto: cuda if any)
    tokenizer = load_tokenizer(cfg.tokenizer.path or base)
    examples = task.examples(cfg.task.train_split)
    examples = examples[: cfg.warm_start.sft.examples] if cfg.warm_start.sft.examples else examples
    pairs = sft_pairs(task, tokenizer, examples, cfg.tools)
    if cfg.warm_start.sft.own_answers:
        pairs = own_answers(model, tokenizer, pairs, cfg.rollout.max_new_tokens)
    train_only_top(model, cfg.warm_start.sft.top_layers)
    with Progress("supervised warm start", cfg.warm_start.sft.steps) as bar:
        train_sft(model, pairs, cfg.warm_start.sft, pad_id=tokenizer.pad_token_id,
                  on_step=lambda step, loss: bar.update(step + 1, f"loss {loss:.3f}"))
    tmp = out.with_name("sft.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp, tokenizer_dir=cfg.tokenizer.path or base)  # copies the tokenizer files too
    _mark_complete(tmp, out, _settings(cfg, "sft"))
    return out


def warm_start(cfg: Config, task) -> Path:
    """Run the configured warm-start stages; returns the checkpoint directory GRPO starts from."""
    base = build_tiny_base(cfg) if cfg.warm_start.tiny.arch else Path(cfg.model.path)
    if cfg.warm_start.sft.steps > 0:
        return run_sft(cfg, base, task)
    return base
