"""The root of the config tree: model, task, rollout, logging, checkpoints, evaluation, and the checks that
span sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .algorithm import AlgorithmSection, ReferenceConfig
from .curriculum import CurriculumSection
from .fields import one_of, option, require, section
from .tools import ToolsSection
from .training import LoRAConfig, MemorySection, OptimizerSection, ScheduleSection, WarmStartSection

DEVICES = ("auto", "cpu", "cuda")
STRATEGIES = ("auto", "ddp", "fsdp2")
BACKENDS = ("auto", "gloo", "nccl")
CUDA_GRAPHS = ("auto", "on", "off")


@dataclass(frozen=True)
class ModelSection:
    path: str = option("", "Hugging Face checkpoint directory (config.json + safetensors) of the policy")
    device: str = option("auto", "where to train: auto picks cuda when available", DEVICES)

    def __post_init__(self) -> None:
        require(self.device in DEVICES, f"model.device={self.device!r} is not one of {', '.join(DEVICES)}")


@dataclass(frozen=True)
class TokenizerSection:
    path: str | None = option(None, "tokenizer directory; None = model.path")


@dataclass(frozen=True)
class TaskSection:
    name: str = option("arithmetic", "registered task name (see grpo_engine.tasks.make_task)")
    data_path: str | None = option(None, "local data file/directory for tasks that read one (gsm8k, math, custom)")
    train_split: str = option("train", "split drawn for training prompts")
    eval_split: str = option("test", "split used by periodic evaluation")
    options: dict[str, Any] = option({}, "extra keyword arguments passed to make_task(name, **options)")


@dataclass(frozen=True)
class RolloutSection:
    prompts_per_step: int = option(4, "P: distinct prompts drawn per optimizer step")
    group_size: int = option(8, "G: completions sampled per prompt (>= 2, advantages are group-relative)")
    max_new_tokens: int = option(256, "completion length cap; longer ones are truncated (finish_reason=length)")
    max_prompt_tokens: int = option(1024, "prompts longer than this are rejected with an error")
    temperature: float = option(1.0, "sampling temperature (also used for training log-probs)")
    top_p: float = option(1.0, "nucleus sampling mass; 1.0 = off")
    top_k: int = option(0, "top-k sampling; 0 = off")
    min_p: float = option(0.0, "min-p sampling threshold; 0.0 = off")
    stop_strings: list[str] = option([], "extra strings that end a completion (EOS ids always do)")
    max_tokens_in_flight: int = option(0, "cap on sequences x tokens decoded at once (0 = all rows together)")
    cuda_graphs: str = option("auto", "how the decode of every rollout, eval and benchmark runs its chunks: each a "
                                      "CUDA graph, checked against an eager chunk when captured (on: CUDA only, a "
                                      "failed check raises), or eagerly (off); auto = on for CUDA (not under FSDP2), "
                                      "and a failed check prints one warning and decodes eagerly for the rest of the "
                                      "process (metrics.jsonl: rollout/cuda_graphs_fallback); off elsewhere",
                              CUDA_GRAPHS)

    def __post_init__(self) -> None:
        # YAML 1.1 reads a bare on / off (also yes / no) as a boolean, which reaches this str field as 'True' / 'False'
        graphs = {"True": "on", "False": "off"}.get(str(self.cuda_graphs), self.cuda_graphs)
        object.__setattr__(self, "cuda_graphs", graphs)  # a frozen section normalizes its own field
        one_of("rollout.cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        for ok, message in [
            (self.group_size >= 2, "rollout.group_size must be >= 2: advantages compare completions of one prompt"),
            (self.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1"),
            (self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
            (self.max_prompt_tokens >= 1, "rollout.max_prompt_tokens must be >= 1"),
            (self.temperature > 0, "rollout.temperature must be > 0"),
            (0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]"),
            (self.top_k >= 0, "rollout.top_k must be >= 0 (0 = off)"),
            (0 <= self.min_p < 1, "rollout.min_p must be in [0, 1)"),
            (self.max_tokens_in_flight >= 0, "rollout.max_tokens_in_flight must be >= 0"),
            (all(self.stop_strings), "rollout.stop_strings must not contain an empty string"),
        ]:
            require(ok, message)


@dataclass(frozen=True)
class LoggingSection:
    progress: bool = option(True, "console progress: a live bar on a terminal, else a plain line per step (or per "
                                  "10 s)")
    samples_every: int = option(10, "write prompt/completion/reward samples to samples.jsonl every N steps; 0 = off")
    samples_per_log: int = option(2, "completions written per sample log")
    tensorboard: bool = option(False, "also log to TensorBoard (needs the `tensorboard` extra)")
    wandb: bool = option(False, "also log to Weights & Biases (needs the `wandb` extra)")
    wandb_project: str = option("grpo-engine", "wandb project name")
    no_signal_warn_steps: int = option(10, "warn after this many steps in a row in which every group's rewards "
                                           "were equal (no learning signal)")

    def __post_init__(self) -> None:
        require(self.samples_every >= 0, "logging.samples_every must be >= 0")
        require(self.samples_per_log >= 0, "logging.samples_per_log must be >= 0")
        require(self.no_signal_warn_steps >= 1, "logging.no_signal_warn_steps must be >= 1")


@dataclass(frozen=True)
class CheckpointSection:
    every: int = option(50, "save every N steps (and always at the end); 0 = only at the end")
    keep_last: int = option(3, "keep the newest K checkpoints; older ones are deleted")

    def __post_init__(self) -> None:
        require(self.every >= 0, "checkpoint.every must be >= 0")
        require(self.keep_last >= 1, "checkpoint.keep_last must be >= 1")


@dataclass(frozen=True)
class EvalSection:
    every: int = option(0, "evaluate on task.eval_split every N steps (and after the last step); 0 = off")
    max_examples: int = option(64, "the first N examples of task.eval_split (a fixed subset, same every time)")
    max_new_tokens: int = option(256, "completion cap during evaluation")
    temperature: float = option(0.0, "sampling temperature during evaluation; 0 = greedy")
    before_after: bool = option(True, "grpo train evaluates the starting model (not on --resume) and the final one on "
                                      "these examples: a table at the end and RUN_DIR/before_after.json")

    def __post_init__(self) -> None:
        require(self.every >= 0, "eval.every must be >= 0")
        require(self.max_examples >= 1, "eval.max_examples must be >= 1")
        require(self.max_new_tokens >= 1, "eval.max_new_tokens must be >= 1")
        require(self.temperature >= 0, "eval.temperature must be >= 0 (0 = greedy)")


@dataclass(frozen=True)
class CheckSection:
    enabled: bool = option(True, "grpo train samples a few groups before step 1, after any warm start, and reports "
                                 "the learning signal (skipped on --resume; --no-check skips it)")
    groups: int = option(16, "prompts the check samples, each with rollout.group_size completions at the rollout's "
                             "settings (rollout.prompts_per_step at a time)")
    min_spread: float = option(0.05, "the share of groups with a reward spread below which the signal is too little")
    stop: bool = option(True, "stop before step 1 (exit 2) when the check finds no or too little signal; false = "
                              "report it and go on")
    fit_length: bool = option(False, "choose rollout.max_new_tokens from the replies: while the check finds 10% or "
                                     "more of them cut, sample again at twice the length, up to "
                                     "check.max_new_tokens_limit and what the device's memory holds; the run trains "
                                     "at the length found (never shorter than set; a resumed run keeps it)")
    max_new_tokens_limit: int = option(512, "the longest rollout.max_new_tokens check.fit_length may choose")
    fit_group_size: bool = option(False, "choose rollout.group_size from the replies (after check.fit_length): while "
                                         "the check finds too little signal (check.min_spread) because right (or "
                                         "wrong) replies are rare, sample again with twice the replies per prompt "
                                         "and half rollout.prompts_per_step (as many replies per step), keeping the "
                                         "larger group only where more of its groups have a spread, up to "
                                         "check.group_size_limit and what the device's memory holds; the run trains "
                                         "with the sizes found (never a smaller group than set; a resumed run keeps "
                                         "them)")
    group_size_limit: int = option(32, "the largest rollout.group_size check.fit_group_size may choose")

    def __post_init__(self) -> None:
        require(self.groups >= 1, "check.groups must be >= 1")
        require(0 <= self.min_spread <= 1, "check.min_spread must be in [0, 1]")
        require(self.max_new_tokens_limit >= 1, "check.max_new_tokens_limit must be >= 1")
        require(self.group_size_limit >= 2, "check.group_size_limit must be >= 2")


@dataclass(frozen=True)
class DistributedSection:
    strategy: str = option("auto", "data parallelism under torchrun: ddp (every rank holds the model, gradients "
                                   "summed once per pass) | fsdp2 (fully_shard: weights, gradients, optimizer state "
                                   "sharded) | auto (ddp when model + optimizer fit one device, else fsdp2)",
                           STRATEGIES)
    backend: str = option("auto", "collectives: auto = nccl on CUDA, gloo on CPU", BACKENDS)
    timeout_minutes: int = option(30, "a collective that waits longer than this fails the run")

    def __post_init__(self) -> None:
        require(self.strategy in STRATEGIES, f"distributed.strategy={self.strategy!r} is not one of "
                                             f"{', '.join(STRATEGIES)}")
        require(self.backend in BACKENDS, f"distributed.backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        require(self.timeout_minutes >= 1, "distributed.timeout_minutes must be >= 1")


@dataclass(frozen=True)
class Config:
    seed: int = option(0, "seeds data order, sampling and initialisation; same seed = same run")
    run_dir: str = option("runs/grpo", "output directory: metrics.jsonl, samples.jsonl, checkpoints/")
    model: ModelSection = section(ModelSection, "policy checkpoint")
    tokenizer: TokenizerSection = section(TokenizerSection, "tokenizer")
    task: TaskSection = section(TaskSection, "task and data")
    rollout: RolloutSection = section(RolloutSection, "generation of completions")
    algorithm: AlgorithmSection = section(AlgorithmSection, "GRPO loss and advantage variants")
    curriculum: CurriculumSection = section(CurriculumSection, "which prompts are served next, from a pool scored "
                                                               "with the policy")
    tools: ToolsSection = section(ToolsSection, "multi-turn rollouts with tool calls")
    reference: ReferenceConfig = section(ReferenceConfig, "reference policy for the KL term (used when beta > 0)")
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters instead of full fine-tuning")
    optimizer: OptimizerSection = section(OptimizerSection, "optimizer and gradient clipping")
    schedule: ScheduleSection = section(ScheduleSection, "steps and learning-rate schedule")
    memory: MemorySection = section(MemorySection, "micro-batching and memory options")
    logging: LoggingSection = section(LoggingSection, "console, metrics and sample logs")
    checkpoint: CheckpointSection = section(CheckpointSection, "checkpoint interval and retention")
    eval: EvalSection = section(EvalSection, "periodic evaluation")
    check: CheckSection = section(CheckSection, "the signal check before training (grpo check, grpo train)")
    warm_start: WarmStartSection = section(WarmStartSection, "tiny base model and supervised phase before GRPO")
    distributed: DistributedSection = section(DistributedSection, "data-parallel training under torchrun")

    def __post_init__(self) -> None:
        """Checks that span sections (each section checks its own fields)."""
        a, r, beta = self.algorithm, self.rollout, self.algorithm.policy_loss.beta
        require(self.seed >= 0, f"seed={self.seed} must be >= 0")
        require(a.advantage.eps > 0, f"algorithm.advantage.eps={a.advantage.eps} must be > 0: it keeps the advantage "
                                     "of a group with a tiny reward spread finite")
        require(not (r.cuda_graphs == "on" and self.model.device == "cpu"),
                "rollout.cuda_graphs=on needs CUDA, but model.device=cpu: set rollout.cuda_graphs=auto (or off)")
        require(beta == 0 or self.reference.mode != "none",
                "algorithm.beta > 0 needs a reference policy: set reference.mode=frozen (or beta=0 for no KL term)")
        require(not (self.lora.enabled and beta > 0 and self.reference.mode != "frozen"),
                "with lora.enabled the reference policy is the base model (adapters off): use reference.mode=frozen")
        require(not (self.check.fit_length and (self.tools.enabled or self.curriculum.mode != "none")),
                "check.fit_length chooses rollout.max_new_tokens, but a run with tools caps its trajectories at "
                "tools.max_tokens and a curriculum scores at its own length: set check.fit_length=false")
        o = a.overlong
        require(not o.soft_punish or 0 < o.cache_len <= (o.max_len or r.max_new_tokens),
                "algorithm.overlong.soft_punish needs 0 < cache_len <= max_len (max_len 0 = rollout.max_new_tokens)")
