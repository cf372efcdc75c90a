"""The CUDA path in one run: bf16 parity, each preset's memory against the planner, rollout speed.

    python benchmarks/gpu_check.py --out REPORT_DIR [--sections parity,memory,speed] [--smoke]

Writes REPORT_DIR/gpu_check.json (every figure) and REPORT_DIR/gpu_check.md (tables): the header (GPU, torch,
CUDA, driver, git commit) first, then again after every measurement, so a run cut short keeps what it measured. A
section or measurement that raises records {"error": "<one line>"} (the traceback goes to stderr) and the run goes
on; without transformers its rows say {"skipped": "transformers not installed"}; without CUDA (and no --smoke) the
report says so and the command exits cleanly. Checkpoints are random weights at the real Qwen2.5 shapes, made by the
project's own make_tiny_checkpoint on the GPU (byte-level tokenizer, 151,936-row vocabulary), cached in
$GRPO_BENCH_CACHE (default ~/.cache/grpo-engine/bench), then scaled so that their logits are peaked as a trained
model's are (the final norm's weight x LOGIT_SCALE, q and k projections x QK_SCALE: attention logits of a few tens;
drawn at std 0.02 the next-token distribution would be near-uniform over 151,936 tokens, and the parity's top-1 and
the mismatch would say little). `--model DIR` runs parity and speed on a real checkpoint instead; the JSON's `weights`
entry says which figures come from random weights. --smoke runs every code path at a toy shape on CPU.

Sections
- parity: logits of our bf16 model vs transformers' bf16 model, both against our fp32 forward (the same
  weights); then the rollout/trainer mismatch: generate()'s log-probs vs the training forward's, in bf16 and fp32,
  with rollout.cuda_graphs on and off, and in bf16 with LoRA adapters whose B is non-zero (sampled under the
  policy's rollout_weights, as training samples; beside it, how much the adapters move the trainer's log-probs).
- memory: one GRPO step per preset config (each in its own process) at its real shape, G=8, 8 prompts,
  512-token completions: torch.cuda max allocated / reserved per phase, beside `grpo plan`'s prediction; the
  report's `step` entry (per preset file: seconds per step, generate / log-probs / update seconds, the update's
  MFU over 989 TFLOP/s bf16, recompute not counted, and the peak reserved) comes from the same steps.
- speed: at the Qwen2.5-0.5B and -1.5B shapes, bf16, 16 prompts x 8 samples x 512 new tokens, EOS ignored
  (but in `ours_training_stops`, whose rows stop at real stop tokens, so batches step down through the buckets;
  `ours_training_top_p` samples with top-p 0.9, the sort path):
  `ours_training`, the exact path training's rollouts take with the default config (rollout.generate with
  train.setup.sampling_params, so rollout.cuda_graphs=auto: the static decode in CUDA graphs on CUDA; per-prompt
  seeds as collect_groups draws them); tokens/s from a second call, the first call's capture seconds apart. Beside
  it transformers' generate with the dynamic and the static cache, and on request (--engines all) our decode with
  eager chunks (rollout.cuda_graphs=off). Tokens/s, the fraction of the HBM bound (weight + KV-cache bytes read
  per decode step over the measured copy bandwidth), and per shape ours_training over the faster transformers
  engine against the issue's 15x target. Each row records the peak memory of that row alone (the counter is reset
  before it) and, for ours, the CUDA graphs captured, the buckets and attention windows run, and any fallback with
  its cause (a failed capture check: the process decodes eagerly; an out-of-memory error: that bucket and larger).

Time on an H100 / H200 (estimated from the recorded H200 figures, not yet measured with this version): parity ~1
min, memory ~4-5 min (four presets, one process each), speed ~5 min (per shape ~45 s for each transformers engine,
~20 s for ours_training's two calls and captures, ~20 s for the checkpoint and loads): all three ~10-11 min; the
issue's figures alone: `--sections speed`, ~5 min. `--engines all` adds ~1.5 min (eager chunks, two shapes).

`--smoke` (CPU, toy shapes, seconds) and `--dry-run` (print the plan, run nothing) check the plumbing without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter
from functools import partial
from pathlib import Path

import torch

from grpo_engine.model.tiny import make_tiny_checkpoint
from grpo_engine.plan.shapes import MODEL_SHAPES

CACHE = Path(os.environ.get("GRPO_BENCH_CACHE", Path.home() / ".cache" / "grpo-engine" / "bench"))
ROOT = Path(__file__).resolve().parent.parent
PRESETS = {  # config -> model shape
    "configs/gpu8gb_qwen2.5-1.5b_qlora.yaml": "qwen2.5-1.5b",
    "configs/gpu12gb_qwen2.5-1.5b_lora.yaml": "qwen2.5-1.5b",
    "configs/gpu8gb_qwen2.5-0.5b_full.yaml": "qwen2.5-0.5b",
    "configs/gpu24gb_qwen2.5-3b_full.yaml": "qwen2.5-3b",
}
SMOKE_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
GIB = 1024**3


@dataclasses.dataclass
class Sizes:
    """How big each section runs: the issue's sizes on a GPU, toy sizes for --smoke."""

    prompts: int = 8
    group: int = 8
    completion: int = 512
    prompt_len: int = 256
    speed_prompts: int = 16
    steps: int = 1


SMOKE = Sizes(prompts=2, group=2, completion=8, prompt_len=40, speed_prompts=2)


LOGIT_SCALE = 8.0  # the final norm's weight: logits of std ~5 (top-1 probabilities of tenths, not 1 / 151,936)
QK_SCALE = 4.0  # q and k projections (weights and biases): attention logits x 16, into the tens
MODEL: Path | None = None  # --model: a real checkpoint for parity and speed (None: the random ones)


def weights_note() -> dict:
    """The report's `weights` entry: where the figures' weights come from."""
    random_figures = ["memory"] + ([] if MODEL else ["parity", "speed"])
    return {"model": str(MODEL) if MODEL else None, "random_weights_in": random_figures,
            "random_scaling": {"final_norm": LOGIT_SCALE, "q_k_proj": QK_SCALE}}


def checkpoint(shape: str, smoke: bool, real: bool = True) -> Path:
    """A random-weight bf16 checkpoint of a named Qwen2.5 shape (drawn on the GPU when there is one), its logits
    peaked (peak_logits); the --model checkpoint instead where `real` and one was given."""
    if real and MODEL is not None:
        return MODEL
    out = CACHE / (f"smoke-{shape}" if smoke else f"random-peaked-{shape}")
    if not (out / "config.json").exists():
        s = MODEL_SHAPES[shape]
        fields = (
            SMOKE_SHAPE
            if smoke
            else dict(
                hidden_size=s.hidden_size,
                intermediate_size=s.intermediate_size,
                num_hidden_layers=s.num_hidden_layers,
                num_attention_heads=s.num_attention_heads,
                num_key_value_heads=s.num_key_value_heads,
                vocab_size=s.vocab_size,
            )
        )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        make_tiny_checkpoint(
            out,
            "qwen2",
            tie_word_embeddings=s.tie_word_embeddings,
            attention_bias=True,
            max_position_embeddings=32768,
            dtype=torch.bfloat16,
            device=device,
            **fields,
        )
        peak_logits(out)
    return out


def peak_logits(path: Path) -> None:
    """Scale a random checkpoint's saved weights in place: the final norm's weight by LOGIT_SCALE (the LM head's
    logits scale with it, tied embeddings or not, the inputs untouched) and the q / k projections by QK_SCALE."""
    from safetensors.torch import load_file, save_file

    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name == "model.norm.weight":
                tensors[name] = t * LOGIT_SCALE
            elif ".q_proj." in name or ".k_proj." in name:
                tensors[name] = t * QK_SCALE
        save_file(tensors, f, metadata={"format": "pt"})


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------
# the report: written first, rewritten after every measurement


def one_line(e: BaseException) -> str:
    """An exception as one line (its type and message, whitespace collapsed, at most 500 characters)."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:500]


def guarded(fn, *args, **kwargs):
    """fn's result, or {"error": one line} when it raises (the traceback goes to stderr): one measurement failing
    must not lose the others, nor the report."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        traceback.print_exc()
        return {"error": one_line(e)}


class Report:
    """The run's report, rewritten to OUT/gpu_check.json (and .md) after every measurement, so a run cut short or
    failing part-way leaves what it measured; its header (the card, torch, CUDA, driver, commit) goes first."""

    def __init__(self, out: Path, data: dict):
        self.out, self.data = out, data
        self.save()

    def save(self) -> None:
        write_report(self.data, self.out)


def command_output(cmd: list[str]) -> str | None:
    """A command's first line of output, or None when it cannot run."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else None


def header() -> dict:
    """What the figures were measured with: the card, torch, its CUDA, the driver, the commit (and whether the tree
    had changes), the date."""
    cuda = torch.cuda.is_available()
    dirty = command_output(["git", "status", "--porcelain", "--untracked-files=no"])
    return {
        "gpu": guarded(gpu_name),
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "commit": command_output(["git", "rev-parse", "HEAD"]),
        "tree_changed": dirty is not None,
        "date": time.strftime("%Y-%m-%d"),
    }


# ----------------------------------------------------------------------------------------------------
# parity


def transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


SKIP_NO_TRANSFORMERS = {"skipped": "transformers not installed"}


def trainer_model(path: Path, dtype: torch.dtype, device: str, lora: bool = False):
    """The model as the trainer holds it (train/policy.py build_policy): loaded, with LoRA adapters when `lora`
    (with_adapters, and the Policy holding it), then the kernel plan applied (apply_kernels: the measured GEMMs and
    decode attention; on CUDA the grouped decode kernel whenever KV heads are grouped, kernels/attention.py
    decode_attention_for). -> (model, policy or None)."""
    from grpo_engine.kernels import apply_kernels
    from grpo_engine.model.loading import load_model

    model, policy = load_model(path, dtype=dtype, device=device), None
    if lora:
        model, policy = with_adapters(model)
    return apply_kernels(model), policy


@torch.no_grad()
def our_logits(path: Path, device: str, dtype: torch.dtype, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Our forward's logits [L, V] (fp32) of each prompt, in `dtype` weights, with the trainer's kernels."""
    model, _ = trainer_model(path, dtype, device)
    return [model(torch.tensor([p], device=device))[0].float() for p in prompts]


@torch.no_grad()
def hf_logits(path: Path, device: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' bf16 forward's logits [L, V] (fp32) of each prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    return [hf(torch.tensor([p], device=device)).logits[0].float() for p in prompts]


def logit_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    d = torch.cat([(x - y).abs().flatten() for x, y in zip(a, b)])
    top1 = torch.cat([(x.argmax(-1) == y.argmax(-1)).float() for x, y in zip(a, b)])
    return {"max_abs": d.max().item(), "mean_abs": d.mean().item(), "top1_agree": top1.mean().item()}


LOGIT_PAIRS = (("ours_bf16_vs_fp32", "ours_bf16", "fp32"), ("hf_bf16_vs_fp32", "hf_bf16", "fp32"),
               ("ours_bf16_vs_hf_bf16", "ours_bf16", "hf_bf16"))


def logits_parity(out: dict, report: Report, path: Path, device: str, prompts: list[list[int]]) -> None:
    """max / mean |logit diff| of our bf16 and transformers' bf16 forward, each against our fp32 forward, into
    `out`; each forward and each pair is its own measurement (a failed one records its error, the rest go on)."""
    runs = {"fp32": partial(our_logits, path, device, torch.float32, prompts),
            "ours_bf16": partial(our_logits, path, device, torch.bfloat16, prompts),
            "hf_bf16": partial(hf_logits, path, device, prompts) if transformers_installed() else None}
    logits = {name: guarded(run) if run is not None else SKIP_NO_TRANSFORMERS for name, run in runs.items()}
    if isinstance(logits["fp32"], list):
        out["logit_std_fp32"] = torch.cat([w.flatten() for w in logits["fp32"]]).std().item()
        out["top1_prob_fp32"] = torch.cat([w.softmax(-1).amax(-1) for w in logits["fp32"]]).mean().item()
    for row, a, b in LOGIT_PAIRS:
        failed = next((logits[k] for k in (a, b) if not isinstance(logits[k], list)), None)
        out[row] = failed if failed is not None else guarded(logit_diff, logits[a], logits[b])
        report.save()


@dataclasses.dataclass(frozen=True)
class MismatchCase:
    """One rollout/trainer mismatch measurement: the weights' dtype, rollout.cuda_graphs, LoRA adapters or not."""

    dtype: str  # bf16 | fp32
    cuda_graphs: str  # on | off
    lora: bool = False

    def label(self) -> dict:
        return {"dtype": self.dtype, "cuda_graphs": self.cuda_graphs, "lora": self.lora}


MISMATCH_CASES = tuple(MismatchCase(dt, g) for dt in ("bf16", "fp32") for g in ("on", "off")) + (
    MismatchCase("bf16", "on", lora=True), MismatchCase("bf16", "off", lora=True))
LORA_B_STD = 1e-3  # lora_B ~ N(0, 1e-3^2): the adapters change W by ~1.5e-4 RMS at the 0.5B shape (alpha/r = 2,
#                    lora_A kaiming-uniform), about one bf16 step of its ~0.02-sized weights: a merge into the bf16
#                    base would round much of it away, so a rollout that merged would show it here


def with_adapters(model):
    """The model with LoRA adapters (rank 16 on every projection, the default LoRAConfig) whose B is non-zero
    (LORA_B_STD, seeded), and the Policy the trainer would hold it in (its rollout_weights is what a rollout runs
    under)."""
    from grpo_engine.config import LoRAConfig
    from grpo_engine.model.lora import apply_lora, lora_modules
    from grpo_engine.plan.policy_spec import PolicySpec
    from grpo_engine.train.policy import Policy

    model = apply_lora(model, LoRAConfig(enabled=True))
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * LORA_B_STD)  # [out, r]
    return model, Policy(model, None, None, None, PolicySpec("lora", "none", False), None)


def rollout_mismatch(path: Path, device: str, prompts: list[list[int]], sizes: Sizes, case: MismatchCase) -> dict:
    """generate()'s per-token log-probs (rollout.cuda_graphs as the case says; with LoRA under the policy's
    rollout_weights, as training samples) vs the training forward's (batch_logprobs) on the same completions, both
    with the trainer's kernels (trainer_model)."""
    from grpo_engine.rollout import SamplingParams, generate
    from grpo_engine.train.batch import build_train_batch
    from grpo_engine.train.forward import batch_logprobs

    if case.cuda_graphs == "on" and not torch.cuda.is_available():
        return {"skipped": "rollout.cuda_graphs=on needs CUDA"}
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    model, policy = trainer_model(path, dtype, device, lora=case.lora)
    weights = policy.rollout_weights() if case.lora else contextlib.nullcontext()
    params = SamplingParams(n=sizes.group, temperature=1.0, max_new_tokens=sizes.completion, stop_token_ids=[],
                            max_tokens_in_flight=None, cuda_graphs=case.cuda_graphs)
    with weights:
        out = generate(model, prompts, params, seed=0)
    rows = [prompts[i] for i in out.prompt_index]
    batch = build_train_batch(rows, out.completion_ids, out.logprobs, torch.zeros(len(rows)), [True] * len(rows),
                                pad_id=0)
    train = batch_logprobs(model, batch, 16384, temperature=1.0, chunk_size=1024)  # [B, T]
    mask = batch.completion_mask.bool()
    log_ratio = (train - batch.sampler_logp)[mask]  # log pi_train / pi_sampler per token
    result = {"tokens": int(mask.sum()), "mean_abs": log_ratio.abs().mean().item(),
              "max_abs": log_ratio.abs().max().item(), "mean": log_ratio.mean().item(),
              "k3": (log_ratio.exp() - 1 - log_ratio).mean().item()}
    if case.lora:  # what the adapters change in the trainer's log-probs: the size the mismatch is to be read beside
        from grpo_engine.model.lora import adapters_disabled

        with adapters_disabled(model):
            base = batch_logprobs(model, batch, 16384, temperature=1.0, chunk_size=1024)
        result["adapter_effect_mean_abs"] = (train - base)[mask].abs().mean().item()
    return result


def parity(report: Report, smoke: bool, sizes: Sizes) -> None:
    """The parity section, into report.data["parity"] measurement by measurement."""
    from grpo_engine.bench.generate import bench_prompts
    from grpo_engine.model.loading import load_tokenizer

    section = report.data["parity"] = {"shape": "qwen2.5-0.5b" if MODEL is None else str(MODEL), "logits": {},
                                       "mismatch": []}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = checkpoint("qwen2.5-0.5b", smoke)
    prompts = bench_prompts(load_tokenizer(path), sizes.prompts)
    logits_parity(section["logits"], report, path, device, prompts)
    for case in MISMATCH_CASES:
        section["mismatch"].append({**case.label(), **guarded(rollout_mismatch, path, device, prompts, sizes, case)})
        report.save()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# memory: one preset per process


class PhasePeaks:
    """Peak CUDA memory of each phase of grpo_step: the step module's phase functions are wrapped in place."""

    def __init__(self):
        self.peaks: dict[str, dict[str, float]] = {}
        self.times: dict[str, float] = {}

    def mark(self, name: str) -> None:
        if torch.cuda.is_available():
            sync()
            self.peaks[name] = {
                "allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            }
            torch.cuda.reset_peak_memory_stats()

    def wrap(self, fn, name: str):
        def wrapped(*args, **kwargs):
            self.mark("before " + name)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.mark(name)
            self.times[name] = time.perf_counter() - t0
            return out

        return wrapped

    def install(self, optimizer) -> None:
        from grpo_engine.train import step as step_module

        step_module.collect_groups = self.wrap(step_module.collect_groups, "rollout")
        step_module.attach_logprobs = self.wrap(step_module.attach_logprobs, "scoring")
        original_step = optimizer.step

        def optimizer_step(*args, **kwargs):  # the backward passes end here: training | optimizer
            self.mark("training")
            out = original_step(*args, **kwargs)
            self.mark("optimizer")
            return out

        optimizer.step = optimizer_step


def profiled(fn, enabled: bool):
    """fn() under torch.profiler when enabled; the 25 ops with the most device time go to stdout."""
    if not enabled:
        return fn()
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        out = fn()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25), file=sys.stderr)
    return out


def one_preset(config: str, smoke: bool, sizes: Sizes, profile_last: bool = False) -> dict:
    """One preset's GRPO steps in this process; the planner's prediction beside the measured peaks."""
    from grpo_engine.bench.step import bench_inputs
    from grpo_engine.plan.from_config import plan_config
    from grpo_engine.train.step import grpo_step

    path = checkpoint(PRESETS[config], smoke, real=False)
    if torch.cuda.is_available():  # drawing a missing checkpoint on the GPU is not part of the preset's peaks
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    extra = [] if torch.cuda.is_available() else ["memory.precision=fp32", "model.device=cpu"]
    if not torch.cuda.is_available() and "offload" in (ROOT / config).read_text():
        extra.append("optimizer.name=adamw")
    inputs, state = bench_inputs(
        str(path),
        prompts=sizes.prompts,
        group=sizes.group,
        max_new=sizes.completion,
        prompt_len=sizes.prompt_len,
        steps=sizes.steps,
        config=str(ROOT / config),
        overrides=[f"run_dir={CACHE / 'runs'}", *extra],
    )
    peaks = PhasePeaks()
    peaks.mark("load")
    peaks.install(inputs.policy.optimizer)
    records = [
        profiled(lambda s=s: grpo_step(inputs, state, s, message=print), profile_last and s == sizes.steps)
        for s in range(1, sizes.steps + 1)
    ]
    plan = plan_config(inputs.cfg, shape=str(path), prompt_len=sizes.prompt_len)
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    m = records[-1].metrics
    return {
        "config": config,
        "shape": PRESETS[config],
        "peaks": peaks.peaks,
        "max_reserved_gib": max((p["reserved_gib"] for p in peaks.peaks.values()), default=0.0),
        "max_allocated_gib": max((p["allocated_gib"] for p in peaks.peaks.values()), default=0.0),
        "outside_torch_gib": (
            (total - free) / GIB - torch.cuda.memory_reserved() / GIB - float(os.environ.get("GPU_CHECK_OTHERS_GIB", 0))
        )
        if total
        else 0.0,
        "plan_total_gib": plan.total_gib,
        "plan_peak_phase": plan.peak_phase,
        "plan_phases_gib": {p.name: p.total / GIB for p in plan.phases},
        "nf4_layers": sum(getattr(mod, "quantized", False) is True for mod in inputs.policy.model.modules()),
        "sec_per_step": m.time_step_s,
        "time_generate_s": m.time_generate_s,
        "time_logprobs_s": m.time_logprobs_s,
        "time_update_s": m.time_update_s,
        "train_tokens": m.train_tokens,
        "step_times": [r.metrics.time_step_s for r in records],
        **update_mfu(plan, m, sizes),
    }


PEAK_BF16_FLOPS = 989e12  # H100 / H200 dense bf16, the datasheet's figure


def update_mfu(plan, m, sizes: Sizes) -> dict:
    """The update's model FLOPs utilisation as issue 44 counts it (recompute not counted): 4 N T for every weight's
    forward and input gradients, 2 N_trainable T for the trained weights' gradients, and causal attention's
    6 L^2 d per row and layer (forward 2 L^2 d, backward twice that). T = the tokens the update runs: the step's
    completion tokens plus each group's shared prompt once."""
    c = plan.model
    groups = max(1, m.rows // sizes.group)
    tokens = m.train_tokens + groups * sizes.prompt_len
    row_len = sizes.prompt_len + m.train_tokens / max(1, m.rows)
    attention = 6 * c.num_hidden_layers * c.hidden_size * m.rows * row_len**2
    flops = 4 * plan.n_params * tokens + 2 * plan.n_trainable * tokens + attention
    return {"update_tokens": tokens, "update_flops": flops,
            "update_mfu": flops / max(m.time_update_s, 1e-9) / PEAK_BF16_FLOPS}


def step_summary(memory_results: list[dict]) -> dict:
    """The report's `step` entry: per preset file, the step's seconds by phase, the update's MFU and the peak."""
    return {Path(r["config"]).name: {"seconds_per_step": r["sec_per_step"], "generate_s": r["time_generate_s"],
                                     "logprobs_s": r["time_logprobs_s"], "update_s": r["time_update_s"],
                                     "update_mfu": r["update_mfu"], "peak_reserved_gib": r["max_reserved_gib"],
                                     "planned_gib": r["plan_total_gib"]}
            for r in memory_results if "error" not in r}


def memory(smoke: bool, out: Path, presets: list[str], steps: int, profile: str,
           report: Report | None = None) -> list[dict]:
    """Each preset in its own process (clean peaks, its own CUDA context); this process's GPU use is passed on.
    With a report, each preset's result goes into report.data["memory"] (and the `step` summary) as it comes."""
    results = []
    if report is not None:
        report.data["memory"] = results
    gc.collect()
    others = 0.0
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        others = (total - free) / GIB
    for config in presets:
        cmd = (
            [
                sys.executable,
                __file__,
                "--one-preset",
                config,
                "--out",
                str(out),
                "--memory-steps",
                str(steps + (config == profile)),
            ]
            + (["--smoke"] if smoke else [])
            + (["--profile", config] if config == profile else [])
        )
        env = {**os.environ, "GPU_CHECK_OTHERS_GIB": str(others)}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        except (subprocess.SubprocessError, OSError) as e:
            results.append({"config": config, "error": one_line(e)})
            continue
        (out / f"preset_{Path(config).stem}.log").write_text(proc.stdout + proc.stderr)
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
        results.append(
            json.loads(line)
            if proc.returncode == 0 and line
            else {"config": config, "error": last_error_line(proc.stderr or proc.stdout)}
        )
        print(json.dumps(results[-1])[:600], flush=True)
        if report is not None:
            report.data["step"] = step_summary(results)
            report.save()
    return results


def last_error_line(output: str) -> str:
    """A failed preset process's error in one line: the last non-empty line of its output (the full output is in
    its log file)."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    return (lines[-1] if lines else "no output")[:500]


# ----------------------------------------------------------------------------------------------------
# speed


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, bytes read + written (the HBM bound's denominator)."""
    if not torch.cuda.is_available():
        return float("nan")
    x = torch.empty(2 * GIB // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - t0)


def step_weight_bytes(cfg) -> float:
    """Bytes of bf16 weights a decode step reads (all of them, the LM head included)."""
    d, v, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    per_layer = 4 * d * d + 2 * d * kv_dim + 3 * d * cfg.intermediate_size  # q,o + k,v + mlp (approx: q,o d x d)
    return 2 * (layers * per_layer + v * d)


def kv_slot_bytes(cfg) -> float:
    """Bytes of one slot's keys and values over all layers, bf16."""
    return 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim


def decode_bytes(cfg, rows: int, prompt_len: float, new: int) -> float:
    """Bytes a decode pass must read from memory: all weights once per step + every row's KV cache so far (the
    least any decode reads: real lengths, no padding, no rounding)."""
    return sum(step_weight_bytes(cfg) + rows * kv_slot_bytes(cfg) * (prompt_len + t) for t in range(new))


def read_bytes(cfg, decode_steps: int, kv_slots_read: int) -> float:
    """Bytes the static decode did read: the weights once per step it ran, and the key / value slots its attention
    windows covered (static_decode_stats' kv_slots_read: rows x window slots per step)."""
    return step_weight_bytes(cfg) * decode_steps + kv_slot_bytes(cfg) * kv_slots_read


def ours_speed(path: Path, sizes: Sizes) -> dict:
    """Our decode with eager chunks, no CUDA graphs (`grpo bench generate --cuda-graphs off`)."""
    from grpo_engine.bench.generate import bench_generate

    args = argparse.Namespace(
        model=str(path),
        prompts=sizes.speed_prompts,
        group=sizes.group,
        max_new=sizes.completion,
        ignore_eos=True,
        temperature=1.0,
        device=None,
        dtype=None,
        cuda_graphs="off",
        seed=0,
    )
    return bench_generate(args)


TOP_P = 0.9  # ours_training_top_p's filter: the sampler's sort path


def training_speed(path: Path, sizes: Sizes, variant: str = "plain") -> dict:
    """`ours_training`: rollout.generate exactly as a training step calls it with the default config (the sampling
    parameters of train.setup.sampling_params, rollout.cuda_graphs=auto; per-prompt seeds as collect_groups draws
    them; the model loaded and kernel-planned as build_policy does), EOS ignored. Two calls: the first allocates the
    static state and captures the graphs (its seconds and the capture seconds are reported apart); the second is
    timed, as every later training step would run. variant "top_p": top-p TOP_P; "stops": rows stop at real stop
    tokens (stop_tokens), so the batch steps down through the buckets. The timed call's graphs, buckets, windows,
    fallbacks and bytes read are recorded (decode_record)."""
    from grpo_engine.bench.generate import bench_prompts
    from grpo_engine.collect.groups import prompt_seed
    from grpo_engine.config import load_config
    from grpo_engine.kernels import apply_kernels
    from grpo_engine.model.loading import load_model, load_tokenizer
    from grpo_engine.rollout import generate
    from grpo_engine.rollout.static_decode import release_static_decode, static_decode_stats
    from grpo_engine.train.setup import sampling_params

    cuda = torch.cuda.is_available()
    cfg = load_config(None, [f"rollout.group_size={sizes.group}", f"rollout.max_new_tokens={sizes.completion}"])
    tok = load_tokenizer(path)
    params = dataclasses.replace(sampling_params(cfg, tok), stop_token_ids=[])  # EOS ignored: T tokens a row
    if variant == "top_p":
        params = dataclasses.replace(params, top_p=TOP_P)
    model = apply_kernels(load_model(path, dtype=torch.bfloat16 if cuda else torch.float32,
                                     device="cuda" if cuda else "cpu"))
    prompts = bench_prompts(tok, sizes.speed_prompts)
    seeds = [prompt_seed(cfg.seed, 1, 0, i) for i in range(len(prompts))]
    extra = {}
    if variant == "stops":
        stops, extra["stop_tokens_from"] = stop_tokens(model, tok, prompts, params, seeds)
        params = dataclasses.replace(params, stop_token_ids=stops)
        extra["stop_tokens"] = stops
    calls, before = [], {}
    for _ in range(2):
        before = static_decode_stats(model) or {}
        sync()
        t0 = time.perf_counter()
        out = generate(model, prompts, params, seed=seeds)
        sync()
        calls.append((time.perf_counter() - t0, out.num_tokens))
    stats = static_decode_stats(model) or {}
    release_static_decode(model)
    (seconds, tokens), first = calls[1], calls[0][0]
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "new_tokens": tokens, "first_call_seconds": first,
            "capture_seconds": stats.get("capture_seconds", 0.0), "captures": stats.get("captures", 0),
            "cuda_graphs": params.cuda_graphs, "static_decode": bool(stats), "top_p": params.top_p,
            "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "mean_new_tokens": tokens / max(1, len(out.completion_ids)), **extra, **decode_record(before, stats)}


def decode_record(before: dict, after: dict) -> dict:
    """What the timed call's static decode did (static_decode_stats before and after it): graphs captured in it and
    held, the buckets and attention windows its chunks ran at, the fallback cause (a failed capture check: the
    process decodes eagerly) and the buckets an out-of-memory error left eager, the steps run and the key/value
    slots read."""
    if not after:
        return {}
    chunks = {k: n - before.get("chunks", {}).get(k, 0) for k, n in after["chunks"].items()}
    ran = {k: n for k, n in chunks.items() if n > 0}
    from grpo_engine.rollout.static_cache import CHUNK

    return {"graphs_captured": after["captures"] - before.get("captures", 0), "graphs_held": after["graphs"],
            "buckets_run": sorted({b for b, _ in ran}), "windows_run": sorted({w for _, w in ran}),
            "graph_fallback": after["fallback"], "out_of_memory_buckets": after["out_of_memory"],
            "eager_from_bucket": after["eager_from_bucket"], "decode_steps": CHUNK * sum(ran.values()),
            "kv_slots_read": after["kv_slots_read"] - before.get("kv_slots_read", 0)}


def stop_tokens(model, tok, prompts: list[list[int]], params, seeds: list[int]) -> tuple[list[int], str]:
    """Stop tokens that end rows at varied lengths: a real checkpoint's (--model) end-of-sequence tokens; for random
    weights (which never pick those), the tokens sampled most often by a call without stops, as few as make the
    rows' mean length at most half of max_new_tokens (a row stops at its first such token: the same seeds sample
    the same tokens up to there)."""
    from grpo_engine.rollout import generate

    if MODEL is not None:
        return list(tok.eos_token_ids), "the tokenizer's end-of-sequence tokens"
    rows = generate(model, prompts, params, seed=seeds).completion_ids
    first = [{} for _ in rows]  # row -> token -> its first position
    for row, seen in zip(rows, first):
        for i, t in enumerate(row):
            seen.setdefault(t, i + 1)
    lengths = [len(r) for r in rows]
    chosen = []
    for t, _ in Counter(t for r in rows for t in r).most_common():
        chosen.append(t)
        lengths = [min(n, seen.get(t, n)) for n, seen in zip(lengths, first)]
        if sum(lengths) <= len(rows) * params.max_new_tokens / 2:
            break
    return chosen, "the most frequent tokens of a call without stops (random weights)"


def hf_speed(path: Path, sizes: Sizes, cache: str | None) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from generate_vs_hf import time_hf

    from grpo_engine.bench.generate import bench_prompts
    from grpo_engine.model.loading import load_tokenizer

    tok = load_tokenizer(path)
    prompts = bench_prompts(tok, sizes.speed_prompts)
    cuda = torch.cuda.is_available()
    seconds, tokens = time_hf(
        path,
        prompts,
        sizes.group,
        sizes.completion,
        tok.pad_token_id,
        dtype=torch.bfloat16 if cuda else torch.float32,
        device="cuda" if cuda else "cpu",
        cache_implementation=cache,
    )
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "new_tokens": tokens}


ENGINES = ("ours_training", "ours_training_stops", "ours_training_top_p", "hf_dynamic", "hf_static", "ours_eager")
DEFAULT_ENGINES = ENGINES[:5]
ESTIMATE_ENGINE_S = {"ours_training": 20, "ours_training_stops": 30, "ours_training_top_p": 20, "hf_dynamic": 45,
                     "hf_static": 45, "ours_eager": 45}  # an H100 / H200, per shape
SPEED_TARGET = 15.0  # issue 42: ours_training >= 15x the faster transformers engine, same run, same shape


def speed_runs(path: Path, sizes: Sizes, shape: str, engines: list[str], hf_static: list[str]) -> dict:
    """engine name -> a call that times it, in the order the section runs them."""
    runs = {
        "ours_training": partial(training_speed, path, sizes),
        "ours_training_stops": partial(training_speed, path, sizes, "stops"),
        "ours_training_top_p": partial(training_speed, path, sizes, "top_p"),
        "hf_dynamic": partial(hf_speed, path, sizes, None),
        "hf_static": partial(hf_speed, path, sizes, "static"),
        "ours_eager": partial(ours_speed, path, sizes),
    }
    if not transformers_installed():
        runs["hf_dynamic"] = runs["hf_static"] = lambda: dict(SKIP_NO_TRANSFORMERS)
    return {name: runs[name] for name in engines if name != "hf_static" or shape in hf_static}


def speed_targets(runs: list[dict]) -> list[dict]:
    """Per shape: ours_training's tokens/s over the faster of transformers' engines, against SPEED_TARGET."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in runs):
        rate = {r["engine"]: r["tokens_per_s"] for r in runs if r["shape"] == shape and "tokens_per_s" in r}
        hf = max((rate[e] for e in ("hf_dynamic", "hf_static") if e in rate), default=None)
        if "ours_training" not in rate or hf is None:
            continue
        ratio = rate["ours_training"] / hf
        out.append({"shape": shape, "ours_training_tokens_per_s": rate["ours_training"], "best_hf_tokens_per_s": hf,
                    "ratio": ratio, "target": SPEED_TARGET, "met": ratio >= SPEED_TARGET})
    return out


def speed(smoke: bool, sizes: Sizes, shapes: list[str], hf_static: list[str],
          engines: list[str] = DEFAULT_ENGINES, report: Report | None = None) -> dict:
    """Each engine at each shape, one measurement each; with a report, into report.data["speed"] as they come."""
    bw = guarded(copy_bandwidth)
    result = {"copy_bandwidth_gb_s": bw / 1e9 if isinstance(bw, float) else float("nan"), "runs": []}
    if isinstance(bw, dict):
        result["copy_bandwidth_error"] = bw["error"]
    if report is not None:
        report.data["speed"] = result
    for shape in shapes:
        shape_runs = guarded(shape_speed, smoke, sizes, shape, engines, hf_static, result["runs"],
                             result["copy_bandwidth_gb_s"] * 1e9, report)
        if isinstance(shape_runs, dict):  # the shape's checkpoint or config failed
            result["runs"].append({"shape": shape, "engine": "-", **shape_runs})
    result["targets"] = speed_targets(result["runs"])
    if report is not None:
        report.save()
    return result


def shape_speed(smoke: bool, sizes: Sizes, shape: str, engines: list[str], hf_static: list[str], runs: list[dict],
                bw: float, report: Report | None) -> None:
    """The engines at one shape, appended to `runs` one by one (a failing engine records its error)."""
    from grpo_engine.model.hf_io import config_from_hf, read_json

    path = checkpoint(shape, smoke)
    cfg = config_from_hf(read_json(path / "config.json"))
    for name, run in speed_runs(path, sizes, shape, engines, hf_static).items():
        if torch.cuda.is_available():  # each row's peak is its own
            torch.cuda.reset_peak_memory_stats()
        r = guarded(run)
        if torch.cuda.is_available():
            r["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        rows = sizes.speed_prompts * sizes.group
        if "seconds" in r and r.get("new_tokens") == rows * sizes.completion:  # every row ran its length
            prompt_len = r.get("mean_prompt_tokens", sizes.prompt_len)
            r["fraction_of_hbm_bound"] = decode_bytes(cfg, rows, prompt_len, sizes.completion) / bw / r["seconds"]
        if "seconds" in r and r.get("decode_steps"):  # what the static decode read, windows rounded up included
            r["read_gb"] = read_bytes(cfg, r["decode_steps"], r["kv_slots_read"]) / 1e9
            r["read_fraction_of_bandwidth"] = r["read_gb"] * 1e9 / bw / r["seconds"]
        runs.append({"shape": shape, "engine": name, **r})
        print(json.dumps(runs[-1]), flush=True)
        if report is not None:
            report.save()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# report


def write_report(report: dict, out: Path) -> None:
    """The JSON first (what a reader needs); the tables after it, an error in them noted instead of raised."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    try:
        text = markdown(report)
    except Exception as e:
        text = f"# gpu_check\n\nthe tables could not be written ({one_line(e)}): read gpu_check.json\n"
    (out / "gpu_check.md").write_text(text)


def failed(x) -> str | None:
    """A measurement's error or skip note (None when it has figures)."""
    if not isinstance(x, dict):
        return None
    if "error" in x:
        return f"error: {x['error'][:200]}"
    return f"skipped: {x['skipped']}" if "skipped" in x else None


def parity_lines(p: dict) -> list[str]:
    lines = ["## bf16 parity (Qwen2.5-0.5B shape, random weights)", ""]
    if failed(p) and "logits" not in p:
        return lines + [failed(p)]
    lines += ["| pair | max abs | mean abs | top-1 |", "|---|---|---|---|"]
    for k, v in p.get("logits", {}).items():
        if failed(v):
            lines.append(f"| {k} | {failed(v)} | | |")
        elif isinstance(v, dict):
            lines.append(f"| {k} | {v['max_abs']:.4g} | {v['mean_abs']:.4g} | {v['top1_agree']:.4f} |")
    lines += ["", "| rollout vs trainer | cuda_graphs | LoRA | tokens | mean abs | max abs | mean | k3 | adapters' "
              "effect |", "|---|---|---|---|---|---|---|---|---|"]
    for m in p.get("mismatch", []):
        case = f"| {m['dtype']} | {m.get('cuda_graphs', 'auto')} | {'yes' if m.get('lora') else 'no'} |"
        if failed(m):
            lines.append(f"{case} {failed(m)} | | | | | |")
            continue
        effect = f"{m['adapter_effect_mean_abs']:.4g}" if "adapter_effect_mean_abs" in m else "-"
        lines.append(f"{case} {m['tokens']} | {m['mean_abs']:.4g} | {m['max_abs']:.4g} | {m['mean']:.3g} | "
                     f"{m['k3']:.3g} | {effect} |")
    return lines + ([failed(p)] if failed(p) else [])


def memory_lines(memory: list[dict] | dict) -> list[str]:
    lines = ["", "## memory per preset (one GRPO step)", ""]
    if isinstance(memory, dict):  # the section failed before or between presets: its error, then what it measured
        return lines + [failed(memory) or ""] + memory_lines(memory.get("measured", []))[3:]
    lines += ["| config | max reserved GiB | max allocated GiB | planned GiB | s/step | generate | log-probs | "
              "update | update MFU |", "|---|---|---|---|---|---|---|---|---|"]
    for m in memory:
        if "error" in m:
            lines.append(f"| {m['config']} | error: {m['error'][-200:]!r} |")
            continue
        lines.append(
            f"| {m['config']} | {m['max_reserved_gib']:.2f} | {m['max_allocated_gib']:.2f} | "
            f"{m['plan_total_gib']:.2f} | {m['sec_per_step']:.1f} | {m['time_generate_s']:.1f} | "
            f"{m['time_logprobs_s']:.1f} | {m['time_update_s']:.1f} | {m.get('update_mfu', float('nan')):.1%} |"
        )
    return lines


def speed_lines(s: dict) -> list[str]:
    lines = ["", f"## rollout speed (copy bandwidth {s.get('copy_bandwidth_gb_s', float('nan')):.0f} GB/s)", ""]
    lines += ["| shape | engine | tokens/s | seconds | HBM-bound fraction |", "|---|---|---|---|---|"]
    for x in s.get("runs", []):
        if failed(x):
            lines.append(f"| {x['shape']} | {x['engine']} | {failed(x)!r} | | |")
            continue
        capture = f" (first call {x['first_call_seconds']:.1f} s, capture {x['capture_seconds']:.1f} s)" \
            if "capture_seconds" in x else ""
        lines.append(f"| {x['shape']} | {x['engine']} | {x['tokens_per_s']:.0f} | {x['seconds']:.1f}{capture} | "
                     f"{x.get('fraction_of_hbm_bound', float('nan')):.3f} |")
    decoded = [x for x in s.get("runs", []) if "graphs_captured" in x]
    if decoded:
        lines += ["", "| shape | engine | new tokens / row | graphs captured (held) | buckets run | windows run | "
                  "fallback | out-of-memory buckets | read GB (of bandwidth) | peak MiB |", "|---" * 10 + "|"]
        for x in decoded:
            read = f"{x['read_gb']:.1f} ({x['read_fraction_of_bandwidth']:.2f})" if "read_gb" in x else "-"
            lines.append(f"| {x['shape']} | {x['engine']} | {x['mean_new_tokens']:.0f} | {x['graphs_captured']} "
                         f"({x['graphs_held']}) | {x['buckets_run']} | {x['windows_run']} | "
                         f"{x['graph_fallback'] or 'none'} | {x['out_of_memory_buckets'] or 'none'} | {read} | "
                         f"{x.get('peak_allocated_mib', float('nan')):.0f} |")
    if s.get("targets"):
        lines += ["", "| shape | ours_training tokens/s | faster transformers | ratio | target |",
                  "|---|---|---|---|---|"]
        for t in s["targets"]:
            verdict = "met" if t["met"] else "MISSED"
            lines.append(f"| {t['shape']} | {t['ours_training_tokens_per_s']:.0f} | {t['best_hf_tokens_per_s']:.0f} | "
                         f"{t['ratio']:.1f}x | {t['target']:.0f}x: {verdict} |")
    return lines + ([failed(s)] if failed(s) else [])


def markdown(r: dict) -> str:
    lines = [f"# gpu_check on {r['gpu']} (torch {r['torch']}, CUDA {r.get('cuda')}, driver {r.get('driver')}, "
             f"commit {str(r.get('commit'))[:12]}, {r['date']})", ""]
    if "error" in r:
        lines += [f"error: {r['error']}", ""]
    if "parity" in r:
        lines += parity_lines(r["parity"])
    if "memory" in r:
        lines += memory_lines(r["memory"])
    if "speed" in r:
        lines += speed_lines(r["speed"])
    return "\n".join(lines) + "\n"


SECTIONS = ("parity", "memory", "speed")
ESTIMATE_S = {"parity": 60, "memory": 70}  # an H100 / H200: parity; per preset (speed: ESTIMATE_ENGINE_S)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--speed-shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--hf-static", default="qwen2.5-0.5b,qwen2.5-1.5b", help="shapes that also time HF's static cache")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help=f"speed engines, of {', '.join(ENGINES)}; `all` = every one")
    ap.add_argument("--speed-prompts", type=int, default=None, help="prompts P of the speed runs (default 16)")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on CPU: every code path, no real figures")
    ap.add_argument("--dry-run", action="store_true", help="print what would run and its estimated time; run nothing")
    ap.add_argument("--presets", default=",".join(PRESETS), help="preset configs of the memory section")
    ap.add_argument("--memory-steps", type=int, default=1, help="GRPO steps per preset (peaks: the last step)")
    ap.add_argument("--profile", default="", help="a preset whose last step (one extra) runs under torch.profiler")
    ap.add_argument("--model", type=Path, default=None,
                    help="a real checkpoint (HF dir) for parity and speed; its shape is the speed section's only one")
    ap.add_argument("--one-preset", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sections = args.sections.split(",")
    args.engines = list(ENGINES) if args.engines == "all" else args.engines.split(",")
    for name, given, known in (("section", args.sections, SECTIONS), ("engine", args.engines, ENGINES),
                               ("shape", args.speed_shapes.split(","), MODEL_SHAPES)):
        unknown = [x for x in given if x not in known]
        if unknown:
            ap.error(f"unknown {name} {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def run_plan(args: argparse.Namespace) -> dict:
    """What the command will run and about how long it takes on an H100 / H200 (ESTIMATE_S)."""
    shapes, static = args.speed_shapes.split(","), args.hf_static.split(",")
    engines = {shape: [e for e in args.engines if e != "hf_static" or shape in static] for shape in shapes}
    presets = args.presets.split(",")
    seconds = {"parity": ESTIMATE_S["parity"], "memory": ESTIMATE_S["memory"] * len(presets),
               "speed": sum(ESTIMATE_ENGINE_S[e] for es in engines.values() for e in es)}
    seconds = {k: v for k, v in seconds.items() if k in args.sections}
    sizes = SMOKE if args.smoke else Sizes()
    return {"sections": args.sections, "speed_engines": engines if "speed" in args.sections else {},
            "presets": presets if "memory" in args.sections else [],
            "speed_size": f"{args.speed_prompts or sizes.speed_prompts} prompts x {sizes.group} x "
                          f"{sizes.completion} new tokens", "estimated_gpu_seconds": seconds,
            "estimated_total_minutes": round(sum(seconds.values()) / 60, 1)}


NO_CUDA = ("no CUDA device (torch.cuda.is_available() is False; torch {torch}, built for CUDA {cuda}): nothing was "
           "measured; run it on a GPU machine, or with --smoke for the plumbing at toy shapes on the CPU")


def run_section(name: str, report: Report, args: argparse.Namespace, sizes: Sizes) -> None:
    """One section into the report; a section that raises records {"error": one line} beside what it measured."""
    try:
        if name == "parity":
            parity(report, args.smoke, sizes)
        elif name == "memory":
            memory(args.smoke, args.out, args.presets.split(","), args.memory_steps, args.profile, report)
        elif name == "speed":
            speed(args.smoke, sizes, args.speed_shapes.split(","), args.hf_static.split(","), args.engines, report)
    except Exception as e:
        traceback.print_exc()
        done = report.data.get(name)
        report.data[name] = {**done, "error": one_line(e)} if isinstance(done, dict) else \
            {"error": one_line(e), **({"measured": done} if done else {})}


def main(argv: list[str] | None = None) -> None:
    global MODEL
    args = parse_args(argv)
    MODEL = args.model
    if MODEL is not None:
        args.speed_shapes, args.hf_static = "model", "model"
    if args.dry_run:
        print(json.dumps(run_plan(args), indent=1))
        return
    sizes = dataclasses.replace(SMOKE if args.smoke else Sizes(), steps=args.memory_steps)
    if args.speed_prompts:
        sizes = dataclasses.replace(sizes, speed_prompts=args.speed_prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one_preset:
        print(json.dumps(one_preset(args.one_preset, args.smoke, sizes, args.profile == args.one_preset)))
        return
    report = Report(args.out, {**header(), "sizes": dataclasses.asdict(sizes), "plan": run_plan(args),
                               "weights": weights_note()})
    if not torch.cuda.is_available() and not args.smoke:
        report.data["error"] = NO_CUDA.format(torch=torch.__version__, cuda=torch.version.cuda)
        report.save()
        print(f"gpu_check: {report.data['error']} (report: {args.out / 'gpu_check.json'})")
        return
    for section in args.sections:
        t0 = time.perf_counter()
        run_section(section, report, args, sizes)
        report.data.setdefault("seconds", {})[section] = time.perf_counter() - t0
        report.save()
        print(f"[{section}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    print(markdown(report.data))


if __name__ == "__main__":
    main()
