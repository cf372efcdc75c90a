"""`grpo bench step`: seconds per GRPO step and peak RSS, running the trainer's own `grpo_step`.

The run is a training config like any other (defaults <- flags <- `key=value` overrides), so the benchmark
measures the defaults users get. Only the task is the benchmark's own: P prompts of exactly --prompt-len
tokens (byte-level tokenizers: random filler in a chat-templated user message), EOS never stops a completion
(every completion has exactly --max-new tokens, the work benchmarks/step_vs_trl.py gives TRL), and the reward
is a seeded pseudo-random number per completion. Why not a function of the text: a random model over a vocabulary
larger than its byte tokenizer samples mostly ids that decode to nothing, every reward of a group is then equal,
and `memory.skip_zero_advantage` would (rightly) leave every row out of the update: the step would time no update.
A random reward differs within every group, so every row trains, as every row does in TRL's step.
"""

from __future__ import annotations

import json
import random
import resource
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..tasks.base import Example, Prompt, RewardResult
from .turns import StepTurns

FILLER = "0123456789+*=abcdefghij"


def add_bench_step_parser(sub) -> None:
    p = sub.add_parser("step", help="time the training step (grpo_step) with fixed-length completions")
    p.add_argument("--model", required=True, help="HF checkpoint directory (or .gguf file)")
    p.add_argument("--config", default=None, help="a training YAML (e.g. a preset) under the flags and overrides")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. memory.micro_batch_tokens=2048")
    p.add_argument("--prompts", type=int, default=4, help="P prompts per step (rollout.prompts_per_step)")
    p.add_argument("--group", type=int, default=8, help="G completions per prompt (rollout.group_size)")
    p.add_argument("--max-new", type=int, default=64, help="completion length (fixed: EOS does not stop)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens, chat template included")
    p.add_argument("--steps", type=int, default=3, help="steps timed; the median excludes the first")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="memory.micro_batch_tokens (default: config's)")
    p.add_argument("--chunk-size", type=int, default=None, help="memory.logprob_chunk_size (default: config's)")
    p.add_argument("--optimizer", default=None, help="optimizer.name (default: the config's)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--turn-fds", default=None, metavar="READ,WRITE",
                   help="for a driver that alternates two engines' steps (benchmarks/step_vs_trl.py): before each "
                        "step write one byte to WRITE and wait for one on READ (grpo_engine/bench/turns.py)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    flags = {"memory.micro_batch_tokens": args.micro_batch_tokens, "memory.logprob_chunk_size": args.chunk_size,
             "optimizer.name": args.optimizer}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + list(args.overrides)
    turns = StepTurns.parse(args.turn_fds) if args.turn_fds else None
    result = bench_step(args.model, prompts=args.prompts, group=args.group, max_new=args.max_new,
                        prompt_len=args.prompt_len, steps=args.steps, threads=args.threads, overrides=overrides,
                        config=args.config, before_step=turns.wait if turns else None)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


@dataclass
class BenchTask:
    """Fixed-length prompts and a reward that varies within every group; nothing to learn."""

    questions: list[str]
    name: str = "bench"
    seed: int = 0

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    def examples(self, split: str) -> list[Example]:
        return [Example(f"bench-{i}", q, "") for i, q in enumerate(self.questions)]

    def prompt(self, example: Example) -> Prompt:
        return Prompt([{"role": "user", "content": example.question}])

    def reward(self, example: Example, completion: str) -> RewardResult:
        return RewardResult(self._rng.random(), {}, None)  # in [0, 1): distinct within a group (almost surely)

    def equivalent(self, a: str, b: str) -> bool:
        return a == b


def bench_questions(tokenizer, count: int, length: int, seed: int = 0) -> list[str]:
    """`count` user messages whose chat-templated prompt is `length` tokens (exact with byte-level tokenizers)."""
    rng = random.Random(seed)
    overhead = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ""}])))
    if length - overhead < 1:
        raise ValueError(f"--prompt-len {length} is shorter than the chat template ({overhead} tokens); raise it")
    return ["".join(rng.choice(FILLER) for _ in range(length - overhead)) for _ in range(count)]


def bench_inputs(model_dir: str, *, prompts: int, group: int, max_new: int, prompt_len: int, steps: int,
                 overrides: list[str] | tuple[str, ...] = (), config: str | None = None):
    """The StepInputs and StepState of a benchmark run: the trainer's own, with BenchTask as the task."""
    from ..collect.groups import ShuffledPrompts
    from ..config import load_config
    from ..model.loading import load_tokenizer, pick_device
    from ..plan.resolved import resolve_settings
    from ..train.policy import build_policy
    from ..train.setup import sampling_params, seed_everything
    from ..train.step import StepInputs, StepState

    cfg = load_config(config, [f"model.path={model_dir}", f"rollout.prompts_per_step={prompts}",
                               f"rollout.group_size={group}", f"rollout.max_new_tokens={max_new}",
                               f"schedule.steps={steps}", "schedule.warmup_steps=0", *overrides])
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer.path or model_dir)
    task = BenchTask(bench_questions(tokenizer, prompts * steps, prompt_len))
    resolved = resolve_settings(cfg, pick_device(cfg.model.device))
    cfg, policy = resolved.config, build_policy(resolved)
    params = replace(sampling_params(cfg, tokenizer), stop_token_ids=[])  # every completion has max_new tokens
    examples = task.examples("train")
    inputs = StepInputs(cfg, policy, tokenizer, task, examples, ShuffledPrompts(len(examples), cfg.seed), params)
    return inputs, StepState(micro_tokens=cfg.memory.micro_batch_tokens)


def bench_step(model_dir: str, *, prompts: int, group: int, max_new: int, prompt_len: int, steps: int,
               threads: int = 0, overrides: list[str] | tuple[str, ...] = (), config: str | None = None,
               before_step: Callable[[], None] | None = None) -> dict:
    """Times `steps` calls of the trainer's grpo_step; `before_step` runs before each (outside its time)."""
    import torch

    from ..kernels import cpu_model
    from ..kernels.threads import fix_threads
    from ..train.step import grpo_step
    from .floor import gemm_rates, weights_precision

    if threads:
        fix_threads(threads)  # the kernel plan keeps this count instead of measuring one
    inputs, state = bench_inputs(model_dir, prompts=prompts, group=group, max_new=max_new, prompt_len=prompt_len,
                                 steps=steps, overrides=overrides, config=config)
    cfg, policy = inputs.cfg, inputs.policy
    on_cpu = policy.device.type == "cpu"
    precision = weights_precision(policy.model) if on_cpu else "fp32"  # the floor's rate in the step's dtype
    records, rates = [], []
    for step in range(1, steps + 1):
        if before_step is not None:
            before_step()
        if on_cpu:  # the floor's GEMM rate before each step (and after the last): the machine's speed drifts
            rates.append(gemm_rates(precision=precision))
        records.append(grpo_step(inputs, state, step, message=lambda _: None))
    if on_cpu:
        rates.append(gemm_rates(precision=precision))  # after the last: each step's floor takes the better reading
    times = [r.metrics.time_step_s for r in records]
    floor = matmul_floor(inputs, prompt_len=prompt_len, max_new=max_new, times=times, rates=rates) if on_cpu else {}
    return {
        "engine": "grpo-engine", "cpu": cpu_model(), "sec_per_step": statistics.median(times[1:] or times),
        "step_times": times,
        "phases": {k: [getattr(r.metrics, f"time_{k}_s") for r in records] for k in ("generate", "logprobs",
                                                                                     "update")},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "prompts": prompts, "group": group, "max_new_tokens": max_new, "prompt_len": prompt_len,
        "params": policy.model.num_parameters(), "threads": torch.get_num_threads(), "precision": cfg.memory.precision,
        "optimizer": cfg.optimizer.name, "micro_batch_tokens": cfg.memory.micro_batch_tokens,
        "chunk_size": cfg.memory.logprob_chunk_size, "overrides": list(overrides),
        **floor,
    }


def step_matmul_flops(inputs, *, prompt_len: int, max_new: int):
    """The matmul FLOPs (bench/floor.py StepFlops) of one step of this run, with its resolved settings."""
    from ..kernels import checkpointed_blocks
    from ..rl.losses import is_tokenwise
    from .floor import StepSizes, step_flops

    cfg, model = inputs.cfg, inputs.policy.model
    mem, n_layers = cfg.memory, model.config.num_hidden_layers
    recompute = len(checkpointed_blocks(model)) / n_layers  # "auto" resolved by build_policy
    tokenwise = is_tokenwise(inputs.update.loss)
    sizes = StepSizes(cfg.rollout.prompts_per_step, cfg.rollout.group_size, prompt_len, max_new,
                      shared_prompt=mem.share_prompt_forward, fused_head=tokenwise,
                      recompute=recompute, mu=cfg.algorithm.mu, reference=inputs.update.loss.beta > 0)
    return step_flops(model.config, sizes)


def matmul_floor(inputs, *, prompt_len: int, max_new: int, times: list[float], rates: list[dict]) -> dict:
    """The step's matmul FLOPs (bench/floor.py) over the best GEMM rate measured around each step (CPU, fp32), and
    each step's time over its own floor; the medians leave out the first step, as sec_per_step does.

    `rates` holds a reading before each step and one after the last; a step's rate is the better of the readings
    just before and just after it. Why: this machine's speed drifts within seconds, and one low reading would
    make that step's floor long and the step look closer to it than it is."""
    flops = step_matmul_flops(inputs, prompt_len=prompt_len, max_new=max_new)
    if len(rates) != len(times) + 1:
        raise ValueError(f"{len(rates)} GEMM rate readings for {len(times)} steps: one before each and one after")
    around = [{k: max(a[k], b[k]) for k in a} for a, b in zip(rates, rates[1:])]  # per step
    floors = [flops.total / max(r.values()) / 1e9 for r in around]  # seconds, one per step
    after_first = slice(1, None) if len(times) > 1 else slice(None)
    return {"matmul_gflop": {"generate": flops.generate / 1e9, "logprobs": flops.logprobs / 1e9,
                             "update": flops.update / 1e9},
            "gemm_gflops": {k: statistics.median(r[k] for r in around[after_first]) for k in around[0]},
            "gemm_gflops_per_step": [max(r.values()) for r in around],
            "floor_s": statistics.median(floors[after_first]),
            "sec_per_step_over_floor": statistics.median(t / f for t, f in zip(times[after_first],
                                                                               floors[after_first]))}
