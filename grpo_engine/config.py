"""The typed configuration tree of a training run.

One dataclass per section; YAML maps 1:1 onto it and `key.sub=value` command-line overrides patch it.
OmegaConf does the merging and type checking (structured configs); this module turns its errors into a
`ConfigError` that names the dotted field, the file and the closest valid name, and checks ranges,
choices and paths BEFORE any model is loaded, so a typo costs a second, not a model load.

Every field carries `metadata={"help": ...}` (and `"choices"` where the value is one of a few names);
`iter_config_docs()` yields them for docs/configuration.md.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .model.lora import LoRAConfig
from .rl.advantages import AdvantageConfig, compute_advantages
from .rl.group_filter import GroupFilterConfig
from .rl.losses import LossConfig
from .rl.losses import resolve as resolve_loss
from .rl.overlong import OverlongConfig
from .rl.semantic_entropy import SemanticEntropyConfig, group_semantic_entropy, modulation_weights
from .train.memory import MemoryConfig
from .train.optim import OptimizerConfig
from .train.reference import ReferenceConfig, make_reference


class ConfigError(ValueError):
    """A configuration problem; the message names the field, the source and the fix."""


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None, **kw: Any):
    """A dataclass field with its one-line doc (and allowed values) attached."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda v=default: copy.deepcopy(v), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _section(cls, help: str):
    """A nested section field: built fresh per instance."""
    return field(default_factory=cls, metadata={"help": help})


@dataclass
class ModelSection:
    path: str = _f("", "Hugging Face checkpoint directory (config.json + safetensors) of the policy")
    device: str = _f("auto", "where to train: auto picks cuda when available", ("auto", "cpu", "cuda"))


@dataclass
class TokenizerSection:
    path: str | None = _f(None, "tokenizer directory; None = model.path")


@dataclass
class TaskSection:
    name: str = _f("arithmetic", "registered task name (see grpo_engine.tasks.make_task)")
    data_path: str | None = _f(None, "local data file/directory for tasks that read one (gsm8k, math, custom)")
    train_split: str = _f("train", "split drawn for training prompts")
    eval_split: str = _f("test", "split used by periodic evaluation")
    options: dict[str, Any] = _f({}, "extra keyword arguments passed to make_task(name, **options)")


@dataclass
class RolloutSection:
    prompts_per_step: int = _f(4, "P: distinct prompts drawn per optimizer step")
    group_size: int = _f(8, "G: completions sampled per prompt (>= 2, advantages are group-relative)")
    max_new_tokens: int = _f(256, "completion length cap; longer ones are truncated (finish_reason=length)")
    max_prompt_tokens: int = _f(1024, "prompts longer than this are rejected with an error")
    temperature: float = _f(1.0, "sampling temperature (also used for training log-probs)")
    top_p: float = _f(1.0, "nucleus sampling mass; 1.0 = off")
    top_k: int = _f(0, "top-k sampling; 0 = off")
    min_p: float = _f(0.0, "min-p sampling threshold; 0.0 = off")
    stop_strings: list[str] = _f([], "extra strings that end a completion (EOS ids always do)")
    max_tokens_in_flight: int = _f(0, "cap on sequences x tokens decoded at once (0 = all rows together)")


@dataclass
class AlgorithmSection(LossConfig):
    """The policy loss (LossConfig's fields, e.g. algorithm.loss=dapo, algorithm.beta=0.04) and the rest of the
    algorithm: advantages, semantic entropy, overlong handling, dynamic sampling, passes per batch."""

    mu: int = _f(1, "policy-gradient passes over each rollout batch (> 1 computes old log-probs first)")
    advantage: AdvantageConfig = _section(AdvantageConfig, "group-relative advantage estimator")
    semantic_entropy: SemanticEntropyConfig = _section(
        SemanticEntropyConfig, "SEED-GRPO modulation (the step's mean semantic entropy is always logged)")
    overlong: OverlongConfig = _section(
        OverlongConfig, "truncated completions (max_len 0 = rollout.max_new_tokens)")
    group_filter: GroupFilterConfig = _section(GroupFilterConfig, "DAPO dynamic sampling of informative groups")


@dataclass
class OptimizerSection(OptimizerConfig):
    """OptimizerConfig (grpo_engine/train/optim.py) plus what the loop does around optimizer.step()."""

    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 = off")
    max_nonfinite_steps: int = _f(3, "stop the run after this many consecutive NaN/inf losses or gradients")


@dataclass
class ScheduleSection:
    steps: int = _f(100, "optimizer steps of the whole run")
    warmup_steps: int = _f(0, "linear warmup from 0 to lr over this many steps")
    lr_schedule: str = _f("constant", "shape after warmup", ("constant", "cosine"))
    min_lr_ratio: float = _f(0.0, "cosine: final lr as a fraction of the peak")


@dataclass
class MemorySection(MemoryConfig):
    """MemoryConfig (grpo_engine/train/memory.py: precision, checkpointing) plus micro-batching."""

    micro_batch_tokens: int = _f(8192, "token budget of one forward/backward micro-batch: padded rows x length, "
                                       "or with share_prompt_forward prompts x prompt length + rows x completion "
                                       "length")
    auto_halve_micro_batch: bool = _f(False, "on CUDA out-of-memory halve micro_batch_tokens and retry the step")
    logprob_chunk_size: int = _f(1024, "tokens per chunk when computing log-probs from hidden states")
    share_prompt_forward: bool = _f(True, "run each prompt once per group in the update forward, its completions "
                                          "attending to its keys/values (same numbers as false, less compute)")
    gpu_memory_gib: float = _f(0.0, "GPU memory of the target card; > 0: `grpo train` refuses, before loading "
                                    "the model, a config the memory planner predicts will not fit; 0 = no check")


@dataclass
class LoggingSection:
    progress: bool = _f(True, "live console progress bar (off automatically when stdout is not a terminal)")
    samples_every: int = _f(10, "write prompt/completion/reward samples to samples.jsonl every N steps; 0 = off")
    samples_per_log: int = _f(2, "completions written per sample log")
    tensorboard: bool = _f(False, "also log to TensorBoard (needs the `tensorboard` extra)")
    wandb: bool = _f(False, "also log to Weights & Biases (needs the `wandb` extra)")
    wandb_project: str = _f("grpo-engine", "wandb project name")


@dataclass
class CheckpointSection:
    every: int = _f(50, "save every N steps (and always at the end); 0 = only at the end")
    keep_last: int = _f(3, "keep the newest K checkpoints; older ones are deleted")


@dataclass
class EvalSection:
    every: int = _f(0, "evaluate on task.eval_split every N steps (and after the last step); 0 = off")
    max_examples: int = _f(64, "the first N examples of task.eval_split (a fixed subset, same every time)")
    max_new_tokens: int = _f(256, "completion cap during evaluation")
    temperature: float = _f(0.0, "sampling temperature during evaluation; 0 = greedy")


@dataclass
class SFTConfig:
    """Supervised warm-start settings."""

    steps: int = _f(0, "optimizer steps of supervised training; 0 = no SFT phase")
    batch_size: int = _f(32, "(prompt, completion) pairs per step")
    lr: float = _f(3e-3, "peak AdamW learning rate (linear warmup, cosine decay)")
    warmup_steps: int = _f(20, "linear warmup steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta2: float = _f(0.95, "AdamW beta2; < 0.999 so the large format-learning gradients of the first steps "
                                 "do not damp later updates for long")
    seed: int = _f(0, "seed for batch order")


@dataclass
class TinyModelSection:
    arch: str = _f("", "build a random tiny model of this family in run_dir/base ('' = start from model.path)",
                   ("", "qwen2", "qwen2-tied", "qwen3", "llama3"))
    hidden_size: int = _f(256, "tiny model width")
    num_hidden_layers: int = _f(4, "tiny model depth")
    num_attention_heads: int = _f(4, "tiny model attention heads")
    num_key_value_heads: int = _f(2, "tiny model key/value heads (grouped-query attention)")
    intermediate_size: int = _f(512, "tiny model SwiGLU width")
    seed: int = _f(0, "seed of the tiny model's random weights")


@dataclass
class WarmStartSection:
    tiny: TinyModelSection = _section(TinyModelSection, "optional tiny random base model (CPU demo, tests)")
    sft: SFTConfig = _section(SFTConfig, "supervised warm start on the task's reference completions; steps=0: off")


@dataclass
class Config:
    seed: int = _f(0, "seeds data order, sampling and initialisation; same seed = same run")
    run_dir: str = _f("runs/grpo", "output directory: metrics.jsonl, samples.jsonl, checkpoints/")
    model: ModelSection = _section(ModelSection, "policy checkpoint")
    tokenizer: TokenizerSection = _section(TokenizerSection, "tokenizer")
    task: TaskSection = _section(TaskSection, "task and data")
    rollout: RolloutSection = _section(RolloutSection, "generation of completions")
    algorithm: AlgorithmSection = _section(AlgorithmSection, "GRPO loss and advantage variants")
    reference: ReferenceConfig = _section(ReferenceConfig, "reference policy for the KL term (used when beta > 0)")
    lora: LoRAConfig = _section(LoRAConfig, "LoRA adapters instead of full fine-tuning")
    optimizer: OptimizerSection = _section(OptimizerSection, "optimizer and gradient clipping")
    schedule: ScheduleSection = _section(ScheduleSection, "steps and learning-rate schedule")
    memory: MemorySection = _section(MemorySection, "micro-batching and memory options")
    logging: LoggingSection = _section(LoggingSection, "console, metrics and sample logs")
    checkpoint: CheckpointSection = _section(CheckpointSection, "checkpoint interval and retention")
    eval: EvalSection = _section(EvalSection, "periodic evaluation")
    warm_start: WarmStartSection = _section(WarmStartSection, "tiny base model and supervised phase before GRPO")


def loss_config(cfg: Config) -> LossConfig:
    """The algorithm section's LossConfig fields as a plain LossConfig; Dr. GRPO's constant normaliser
    defaults to rollout.max_new_tokens."""
    values = {f.name: getattr(cfg.algorithm, f.name) for f in dataclasses.fields(LossConfig)}
    values["max_completion_len"] = values["max_completion_len"] or cfg.rollout.max_new_tokens
    return LossConfig(**values)


# ----------------------------------------------------------------------------------------------------
# Loading


def _dotted_names(cls=Config, prefix: str = "") -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        names.append(prefix + f.name)
        sub = _section_class(cls, f.name)
        if sub is not None:
            names += _dotted_names(sub, prefix + f.name + ".")
    return names


def _section_class(cls, name: str):
    """The dataclass type of field `name` of `cls`, or None for a leaf (annotations are strings here)."""
    default = next(f for f in dataclasses.fields(cls) if f.name == name)
    if default.default_factory is not dataclasses.MISSING:
        value = default.default_factory()
        if dataclasses.is_dataclass(value):
            return type(value)
    return None


def _closest(full_key: str) -> str:
    """' (did you mean X?)' for an unknown dotted key, or a list of the valid keys at that level."""
    names = _dotted_names()
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    siblings = [n for n in names if n.rsplit(".", 1)[0] == parent and n.count(".") == full_key.count(".")]
    if not parent:
        siblings = [n for n in names if "." not in n]
    match = difflib.get_close_matches(full_key, siblings, n=1, cutoff=0.5)
    if not match:
        match = difflib.get_close_matches(full_key, names, n=1, cutoff=0.6)
    if match:
        return f" (did you mean {match[0]!r}?)"
    leaves = ", ".join(s.rsplit(".", 1)[-1] for s in siblings)
    return f" (valid keys under {parent or 'the top level'}: {leaves})"


def _raise_from_omegaconf(e: OmegaConfBaseException, source: str) -> None:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if isinstance(e, ConfigKeyError) or "not in" in msg or "Key '" in msg and "not" in msg:
        raise ConfigError(f"{source}: unknown config key {key!r}{_closest(key)}") from None
    if isinstance(e, ValidationError):
        raise ConfigError(f"{source}: wrong type for {key!r}: {msg}") from None
    raise ConfigError(f"{source}: invalid value for {key!r}: {msg}") from None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- `a.b=value` overrides, type-checked, then range-checked by validate()."""
    merged: DictConfig = OmegaConf.structured(Config)
    if path is not None:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(_read_yaml(Path(path))))
        except OmegaConfBaseException as e:
            _raise_from_omegaconf(e, str(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. rollout.group_size=16)")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            _raise_from_omegaconf(e, f"override {item!r}")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        _raise_from_omegaconf(e, str(path or "config"))
    except ValueError as e:  # a section's own __post_init__ check (optimizer, memory, lora)
        raise ConfigError(f"{path or 'config'}: {e}") from None
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_yaml_text(text: str) -> Config:
    """Rebuild a Config from `to_yaml` output (checkpoints store the config this way)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(yaml.safe_load(text) or {}))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        _raise_from_omegaconf(e, "stored config")
        raise  # unreachable


# ----------------------------------------------------------------------------------------------------
# Validation (no model loading here)


def _check_choices(obj, prefix: str = "") -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{f.name}.")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            hint = difflib.get_close_matches(str(value), choices, n=1)
            did = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{prefix}{f.name}={value!r} is not one of {', '.join(choices)}{did}")


def _ranges(cfg: Config) -> list[tuple[bool, str]]:
    """(condition that must hold, message when it does not)."""
    r, a, o, s = cfg.rollout, cfg.algorithm, cfg.optimizer, cfg.schedule
    return [
        (r.group_size >= 2, "rollout.group_size must be >= 2: advantages compare completions of one prompt"),
        (r.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1"),
        (r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (r.max_prompt_tokens >= 1, "rollout.max_prompt_tokens must be >= 1"),
        (r.temperature > 0, "rollout.temperature must be > 0"),
        (0 < r.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        (r.top_k >= 0, "rollout.top_k must be >= 0 (0 = off)"),
        (0 <= r.min_p < 1, "rollout.min_p must be in [0, 1)"),
        (r.max_tokens_in_flight >= 0, "rollout.max_tokens_in_flight must be >= 0"),
        (a.mu >= 1, "algorithm.mu must be >= 1"),
        (a.group_filter.max_rounds >= 1, "algorithm.group_filter.max_rounds must be >= 1"),
        (not a.overlong.soft_punish or 0 < a.overlong.cache_len <= (a.overlong.max_len or r.max_new_tokens),
         "algorithm.overlong.soft_punish needs 0 < cache_len <= max_len (max_len 0 = rollout.max_new_tokens)"),
        (a.beta == 0 or cfg.reference.mode != "none",
         "algorithm.beta > 0 needs a reference policy: set reference.mode=frozen (or beta=0 for no KL term)"),
        (not (cfg.lora.enabled and a.beta > 0 and cfg.reference.mode != "frozen"),
         "with lora.enabled the reference policy is the base model (adapters off): use reference.mode=frozen"),
        (o.grad_clip >= 0, "optimizer.grad_clip must be >= 0 (0 = off)"),
        (o.max_nonfinite_steps >= 1, "optimizer.max_nonfinite_steps must be >= 1"),
        (s.steps >= 1, "schedule.steps must be >= 1"),
        (0 <= s.warmup_steps <= s.steps, "schedule.warmup_steps must be in [0, schedule.steps]"),
        (0 <= s.min_lr_ratio <= 1, "schedule.min_lr_ratio must be in [0, 1]"),
        (cfg.memory.micro_batch_tokens >= 1, "memory.micro_batch_tokens must be >= 1"),
        (cfg.memory.logprob_chunk_size >= 1, "memory.logprob_chunk_size must be >= 1"),
        (cfg.memory.gpu_memory_gib >= 0, "memory.gpu_memory_gib must be >= 0 (0 = no memory pre-flight check)"),
        (cfg.logging.samples_every >= 0, "logging.samples_every must be >= 0"),
        (cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0"),
        (cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last must be >= 1"),
        (cfg.eval.every >= 0, "eval.every must be >= 0"),
        (cfg.eval.max_examples >= 1, "eval.max_examples must be >= 1"),
        (cfg.eval.max_new_tokens >= 1, "eval.max_new_tokens must be >= 1"),
        (cfg.eval.temperature >= 0, "eval.temperature must be >= 0 (0 = greedy)"),
    ]


def _algorithm_checks(cfg: Config) -> None:
    """The rl library's own validation of names and numbers, run now rather than at step 1."""
    a = cfg.algorithm
    checks = {
        "algorithm": lambda: resolve_loss(loss_config(cfg)),
        "algorithm.advantage": lambda: compute_advantages(torch.zeros(1, 2), a.advantage),
        "algorithm.semantic_entropy": lambda: (group_semantic_entropy([], str.__eq__, a.semantic_entropy),
                                               modulation_weights(torch.zeros(1), 2, a.semantic_entropy)),
        "reference": lambda: make_reference(torch.nn.Linear(1, 1), cfg.reference, beta=0.0 if
                                            cfg.reference.mode == "none" else 1.0),
    }
    for section, check in checks.items():
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{section}: {e}") from None


def validate(cfg: Config) -> None:
    """Choices and ranges; paths are checked separately by check_paths (they may be set by overrides)."""
    _check_choices(cfg)
    for ok, message in _ranges(cfg):
        if not ok:
            raise ConfigError(message)
    _algorithm_checks(cfg)


TOKENIZER_REQUIRED = ("tokenizer.json",)


def check_paths(cfg: Config) -> None:
    """Model, tokenizer and data paths exist and look right; run before any weights are read."""
    if cfg.task.data_path is not None and not Path(cfg.task.data_path).exists():
        raise ConfigError(f"task.data_path={cfg.task.data_path!r} does not exist")
    if cfg.warm_start.tiny.arch:
        return  # the warm start builds the model and its tokenizer (train/warm_start.py)
    if not cfg.model.path:
        raise ConfigError("model.path is empty: set it in the YAML or with model.path=/path/to/hf_checkpoint")
    model_dir = Path(cfg.model.path)
    if not model_dir.is_dir():
        raise ConfigError(f"model.path={cfg.model.path!r}: directory does not exist")
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r} has no config.json: is it a Hugging Face checkpoint dir?")
    if not any(model_dir.glob("*.safetensors")):
        raise ConfigError(f"model.path={cfg.model.path!r} has no *.safetensors weights")
    tok_dir = Path(cfg.tokenizer.path or cfg.model.path)
    missing = [n for n in TOKENIZER_REQUIRED if not (tok_dir / n).is_file()]
    if missing:
        raise ConfigError(f"tokenizer directory {str(tok_dir)!r} lacks {', '.join(missing)}; set tokenizer.path")


# ----------------------------------------------------------------------------------------------------
# Docs


def _comment_help(cls, name: str) -> str:
    """The trailing `# comment` of field `name` in the source of the class that declares it.

    The rl / optim dataclasses embedded in the tree document their fields with such comments; reading them
    keeps one source of truth instead of copying every line into metadata.
    """
    pattern = re.compile(rf"^\s+{re.escape(name)}\s*:[^#]*#\s*(.+)$")
    for klass in cls.__mro__:
        if name not in getattr(klass, "__annotations__", {}):
            continue
        for line in inspect.getsource(klass).splitlines():
            match = pattern.match(line)
            if match:
                return match.group(1).strip()
    return ""


def iter_config_docs(cls=Config, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """(dotted_name, type, default, help) of every leaf field, in declaration order."""
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            yield from iter_config_docs(type(value), f"{prefix}{f.name}.")
            continue
        help_text = f.metadata.get("help") or _comment_help(cls, f.name)
        if "choices" in f.metadata:
            help_text += f" [{' | '.join(f.metadata['choices'])}]"
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        yield prefix + f.name, type_name, value, help_text


def config_docs_markdown() -> str:
    """docs/configuration.md: one table of every field (tests/test_config_docs.py keeps the file in sync)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config tree's field docs (`python -m grpo_engine.config > docs/configuration.md`);",
        "a test fails when this file and grpo_engine/config.py disagree. YAML keys map 1:1 onto these dotted",
        "names, and any of them can be overridden on the command line: `grpo train CONFIG rollout.group_size=16`.",
        "",
        "| field | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, type_name, default, help_text in iter_config_docs():
        shown = repr(default) if isinstance(default, str) else default
        kind = type_name.replace(' | ', ' or ')
        lines.append(f"| `{name}` | {kind} | `{shown}` | {help_text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(config_docs_markdown(), end="")
