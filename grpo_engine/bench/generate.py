"""`grpo bench generate`: time the rollout sampler on a checkpoint with fixed lengths; one JSON line of figures.

The prompts are chat-templated questions of ~100-150 tokens (byte-level tiny tokenizers; fewer with real
BPE tokenizers). The same prompt builder feeds benchmarks/generate_vs_hf.py so both engines see one batch.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

QUESTIONS = [
    "Using the numbers 3, 7, 25 and 50, write an equation that equals 124. Show your reasoning step by step.",
    "A train leaves at 9:40 and arrives at 13:05. How many minutes does the trip take? Explain briefly.",
    "What is the sum of all positive divisors of 360? Think it through before giving the final answer.",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in total?",
    "Find the remainder when 7 to the power 2024 is divided by 13, and justify each step of the argument.",
    "If a rectangle has perimeter 46 and area 120, what are its side lengths? Reason carefully and check.",
    "Convert the repeating decimal 0.363636... into a fraction in lowest terms and explain the method used.",
    "How many ways can 5 distinct books be arranged on a shelf if two particular books must be adjacent?",
]


def bench_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat-templated prompts, cycling through QUESTIONS (lengths differ a little)."""
    messages = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]
    return [tokenizer.encode(tokenizer.apply_chat_template(m, add_generation_prompt=True)) for m in messages]


def add_bench_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="time rollout generation (tokens/s)")
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--prompts", type=int, default=4, help="number of prompts P")
    p.add_argument("--group", type=int, default=8, help="samples per prompt G")
    p.add_argument("--max-new", type=int, default=64, help="max new tokens T")
    p.add_argument("--ignore-eos", action="store_true", help="no stop tokens: every completion has T tokens")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the dtype memory.precision=auto "
                                                 "gives a LoRA run of the model here: bf16 on a GPU with it, on a "
                                                 "CPU where it pays, else fp32)")
    p.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                   help="rollout.cuda_graphs: the decode's chunks in CUDA graphs (auto = on CUDA) or eagerly")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a sentence")
    p.set_defaults(func=lambda args: _print(bench_generate(args), args.json))
    return p


def _print(r: dict, as_json: bool) -> None:
    sentence = f"{r['tokens_per_s']:.1f} tokens/s ({r['new_tokens']} tokens in {r['seconds']:.2f} s)"
    print(json.dumps(r) if as_json else sentence)


def bench_generate(args: argparse.Namespace, prompts: list[list[int]] | None = None) -> dict:
    """Warm up once with a short run, then time one full generate() call; its figures as one JSON-ready dict.

    prompts: token ids to generate from (default: bench_prompts' args.prompts questions), so that a peer engine's
    benchmark (benchmarks/generate_vs_llamacpp.py) times this same call on its own work."""
    import torch

    from ..kernels import apply_kernels, cpu_model
    from ..model.loading import load_model, load_tokenizer
    from ..rollout import SamplingParams, generate
    from ..rollout.static_decode import cuda_graphs_on, static_decode_stats

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or default_dtype(args.model, args.device)
    model = apply_kernels(load_model(args.model, dtype=getattr(torch, dtype_name), device=args.device))
    tok = load_tokenizer(args.model)
    prompts = bench_prompts(tok, args.prompts) if prompts is None else prompts
    stops = [] if args.ignore_eos else tok.eos_token_ids
    params = SamplingParams(
        n=args.group, temperature=args.temperature, max_new_tokens=args.max_new, stop_token_ids=stops,
        max_tokens_in_flight=None, cuda_graphs=getattr(args, "cuda_graphs", "auto"),
    )
    cuda = str(args.device).startswith("cuda")
    graphs = cuda_graphs_on(params.cuda_graphs, model.device)
    # the static decode sizes its state and captures its graphs in the first call of a shape: warm up at full length
    warm = params if graphs else SamplingParams(**{**asdict(params), "max_new_tokens": min(4, args.max_new)})
    generate(model, prompts, warm, seed=args.seed)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = generate(model, prompts, params, seed=args.seed)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": out.num_tokens / seconds, "seconds": seconds, "new_tokens": out.num_tokens,
            "prompts": len(prompts), "group": args.group, "max_new_tokens": args.max_new,
            "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts), "device": str(args.device),
            "dtype": dtype_name, "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "cpu": cpu_model(),  # the figures depend on it even on a GPU (the host's Python and sampler)
            **graphs_report(graphs, static_decode_stats(model))}


def default_dtype(model: str, device: str) -> str:
    """The dtype a run of `model` with memory.precision=auto samples in on `device` (plan/precision.py
    choose_precision, the same for adapters and for full fine-tuning at the optimizer's defaults): the sampler timed
    as such a run drives it."""
    from ..plan.precision import choose_precision
    from ..plan.shapes import model_shape

    shape = model_shape(model)
    choice = choose_precision("auto", device, (shape.hidden_size, shape.intermediate_size))
    return {"fp32": "float32", "bf16": "bfloat16"}[choice.precision]


def graphs_report(graphs: bool, stats: dict | None) -> dict:
    """Whether the timed call decoded in CUDA graphs: rollout.cuda_graphs turned them on and no capture check failed
    (after one, `auto` decodes the same state eagerly: static_decode_stats' "fallback" is its cause); the captures'
    seconds, spent in the warm-up."""
    stats = stats or {}
    return {"cuda_graphs": graphs and stats.get("fallback") is None, "cuda_graphs_fallback": stats.get("fallback"),
            "capture_seconds": stats.get("capture_seconds", 0.0)}
