"""Rollout speed: grpo_engine.generate vs transformers' generate, same checkpoint, same batch, one run.

Both engines get the same P chat-templated prompts (~100-150 tokens), G samples each, exactly T new tokens
(EOS ignored: no stop ids for ours, min_new_tokens=T for HF), pure sampling (temperature 1, top_k 0,
top_p 1), transformers in fp32 on CPU; ours with the kernel plan the trainer uses (kernels/select.py) in fp32 and,
where a LoRA run's memory.precision=auto chooses bf16 on this CPU (plan/precision.py), in that default too
(`default_*` fields: the engine's default settings against transformers' default). We print tokens/s for
both and the ratio, and how close ours gets to this machine's matmul-bound limit: FLOPs of our generation
(2 x matmul params per token through the layers and LM head, plus attention scores) over the time, against a
large fp32 matmul's FLOP rate measured here.

    PYTHONPATH=. python benchmarks/generate_vs_hf.py [--threads 2] [--repeats 1] [--skip-tiny]
        [--models qwen2-100m qwen2-100m-tied tiny-demo smollm2-135m]

The 100M checkpoint (Qwen2 shape, 151,936 vocab) is written once to $GRPO_BENCH_CACHE
(default ~/.cache/grpo-engine/bench).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from grpo_engine.bench.generate import bench_prompts, default_dtype
from grpo_engine.kernels import apply_kernels
from grpo_engine.model.loading import load_model, load_tokenizer
from grpo_engine.model.tiny import make_tiny_checkpoint
from grpo_engine.rollout import SamplingParams, generate

CACHE = Path(os.environ.get("GRPO_BENCH_CACHE", Path.home() / ".cache" / "grpo-engine" / "bench"))
MODELS = {  # name -> (make_tiny_checkpoint arch, shape)
    "qwen2-100m": ("qwen2", dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1408, vocab_size=151936,
    )),
    # the SMALL shape of the speed targets: the same, with the LM head tied to the embedding (100.3M params)
    "qwen2-100m-tied": ("qwen2", dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1408, vocab_size=151936, tie_word_embeddings=True,
    )),
    "tiny-demo": ("qwen2", dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=256)),
    # SmolLM2-135M-Instruct's config (Llama, tied, no RoPE scaling), random weights
    "smollm2-135m": ("llama3", dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, rope_scaling=None,
        rms_norm_eps=1e-5, max_position_embeddings=8192,
    )),
}


def checkpoint(name: str) -> Path:
    out = CACHE / name
    if not (out / "config.json").exists():
        arch, shape = MODELS[name]
        make_tiny_checkpoint(out, arch, **shape)
    return out


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best observed fp32 FLOP/s of an n x n matmul on this machine (the matmul-bound limit), over torch.mm
    and oneDNN (grpo_engine.kernels.onednn, which our LM head uses): on AMD CPUs oneDNN is about 2x MKL."""
    from grpo_engine.kernels import onednn

    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for matmul in (lambda: a @ b, lambda: onednn.linear(a, b)):
        matmul()
        for _ in range(repeats):
            t0 = time.perf_counter()
            matmul()
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def generation_flops(model, prompt_lens: list[int], group: int, new: int) -> float:
    """FLOPs of our generation: prefill once per prompt (LM head at the last position), decode G*T tokens."""
    cfg = model.config
    layer_params = sum(p.numel() for n, p in model.layers.named_parameters() if p.dim() == 2)
    head = model.lm_head.weight.numel()
    attn_per_ctx = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers  # QK^T and PV
    flops = 0.0
    for L in prompt_lens:
        flops += 2 * layer_params * L + 2 * head + attn_per_ctx * L * (L + 1) / 2
        flops += group * sum(2 * (layer_params + head) + attn_per_ctx * (L + t + 1) for t in range(new))
    return flops


def time_ours(path: Path, prompts, group: int, new: int, dtype=torch.float32) -> tuple[float, int, object]:
    model = apply_kernels(load_model(path, dtype=dtype))  # the kernel plan the trainer runs with
    params = SamplingParams(n=group, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new,
                            stop_token_ids=[], max_tokens_in_flight=None)
    generate(model, prompts, SamplingParams(n=group, max_new_tokens=2, max_tokens_in_flight=None))  # warm-up
    t0 = time.perf_counter()
    out = generate(model, prompts, params, seed=0)
    seconds = time.perf_counter() - t0
    assert all(len(c) == new for c in out.completion_ids)
    return seconds, out.num_tokens, model


def time_hf(path: Path, prompts, group: int, new: int, pad_id: int, *, dtype=torch.float32, device: str = "cpu",
            cache_implementation: str | None = None) -> tuple[float, int]:
    """Seconds and new tokens of one transformers generate() call (after a 2-token warm-up).

    cache_implementation: None (transformers' default dynamic cache) or e.g. "static"."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    L = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts], device=device)  # left padding, as HF expects
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=group,
                  pad_token_id=pad_id, cache_implementation=cache_implementation)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        torch.manual_seed(0)
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kwargs)
        sync()
        seconds = time.perf_counter() - t0
    n_tokens = (out.shape[1] - L) * out.shape[0]
    assert out.shape == (len(prompts) * group, L + new), out.shape
    return seconds, n_tokens


def run(name: str, prompts_n: int, group: int, new: int, repeats: int, peak: float) -> dict:
    path = checkpoint(name)
    tok = load_tokenizer(path)
    prompts = bench_prompts(tok, prompts_n)
    hf_runs = [time_hf(path, prompts, group, new, tok.pad_token_id) for _ in range(repeats)]
    hf = min(hf_runs, key=lambda r: r[0])
    ours = min((time_ours(path, prompts, group, new) for _ in range(repeats)), key=lambda r: r[0])
    flops = generation_flops(ours[2], [len(p) for p in prompts], group, new)
    dtype = getattr(torch, default_dtype(str(path), "cpu"))
    default = ours if dtype == torch.float32 else min(
        (time_ours(path, prompts, group, new, dtype) for _ in range(repeats)), key=lambda r: r[0])
    return {
        "model": name,
        "params_M": round(ours[2].num_parameters() / 1e6, 1),
        "prompts": prompts_n, "group": group, "max_new": new,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "ours_tokens_per_s": ours[1] / ours[0],
        "hf_tokens_per_s": hf[1] / hf[0],
        "ratio": (ours[1] / ours[0]) / (hf[1] / hf[0]),
        "ours_s": ours[0], "hf_s": hf[0],
        "ours_gflops": flops / ours[0] / 1e9,
        "matmul_peak_gflops": peak / 1e9,
        "fraction_of_matmul_limit": flops / ours[0] / peak,
        "default_dtype": str(dtype).removeprefix("torch."),
        "default_tokens_per_s": default[1] / default[0],
        "default_ratio": (default[1] / default[0]) / (hf[1] / hf[0]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine; the best is kept")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--models", nargs="+", choices=list(MODELS),
                    help="default: qwen2-100m tiny-demo (without tiny-demo with --skip-tiny)")
    args = ap.parse_args()
    from grpo_engine.kernels.threads import fix_threads  # the engine's plan keeps this count

    fix_threads(args.threads)
    peak = matmul_peak_flops()
    names = args.models or ["qwen2-100m"] + ([] if args.skip_tiny else ["tiny-demo"])
    rows = [run(n, args.prompts, args.group, args.max_new, args.repeats, peak) for n in names]
    from grpo_engine.kernels import cpu_model

    print(f"{cpu_model()}  threads={args.threads}  matmul-bound limit {peak / 1e9:.1f} GFLOP/s "
          "(fp32 2048^3, best of torch.mm and oneDNN)")
    header = ["model", "params", "ours tok/s", "HF tok/s", "ratio", "ours GFLOP/s", "of limit", "default",
              "default tok/s", "its ratio"]
    print(f"{header[0]:<12} " + " ".join(f"{h:>12}" for h in header[1:]))
    for r in rows:
        cells = [f"{r['params_M']:.1f}M", f"{r['ours_tokens_per_s']:.1f}", f"{r['hf_tokens_per_s']:.1f}",
                 f"{r['ratio']:.2f}x", f"{r['ours_gflops']:.1f}", f"{r['fraction_of_matmul_limit']:.1%}",
                 r["default_dtype"], f"{r['default_tokens_per_s']:.1f}", f"{r['default_ratio']:.2f}x"]
        print(f"{r['model']:<12} " + " ".join(f"{c:>12}" for c in cells))
    print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "results": rows}))


if __name__ == "__main__":
    main()
