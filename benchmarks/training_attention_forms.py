"""Which masked training attention with grouped KV heads a CUDA card runs best: forward + backward seconds and peak
memory of three forms at the Qwen2.5-1.5B head shape (12 query heads over 2 KV heads of 128), bf16, a left-padded
causal batch:

- grouped_sdpa: the engine's (model/transformer.py): each KV head's query heads stacked along the queries, one bias;
- repeat_kv: K and V copied to every query head, then SDPA with the mask (the form it replaced);
- enable_gqa: SDPA's own enable_gqa with the mask (on the builds the engine supports, its math kernel).

    python benchmarks/training_attention_forms.py [--rows 8] [--tokens 1024] [--out FILE.json]

Prints one JSON line (and writes it to --out): per form the median milliseconds of 5 timed runs after 2 warm-ups and
the peak memory above the inputs, or the error it raised. CUDA only: without a card it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo_engine.model.transformer import cuda_attention_bias, grouped_sdpa  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def repeat_kv(q, k, v, mask_bias):
    G = q.shape[1] // k.shape[1]
    rep = lambda x: x.repeat_interleave(G, dim=1)  # noqa: E731 - [B, H, S, D]
    return F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask_bias)


def enable_gqa(q, k, v, mask_bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_bias, enable_gqa=True)


def inputs(rows: int, tokens: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, tokens, HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    q = q.transpose(1, 2).requires_grad_()  # [B, H, T, D] as the model lays it out
    k, v = (torch.randn(rows, KV_HEADS, tokens, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
            .requires_grad_() for _ in range(2))
    pad = torch.arange(rows, device="cuda")[:, None] * 7  # row r left-padded by 7 r tokens
    real = torch.arange(tokens, device="cuda")[None, :] >= pad
    mask = torch.ones(tokens, tokens, dtype=torch.bool, device="cuda").tril() & real[:, None, :]
    mask = (mask | torch.eye(tokens, dtype=torch.bool, device="cuda"))[:, None]  # [B, 1, T, S]
    return q, k, v, mask


def measure(form, q, k, v, bias) -> dict:
    def once():
        out = form(q, k, v, bias)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    for _ in range(2):
        once()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        result = {"skipped": "no CUDA device"}
    else:
        q, k, v, mask = inputs(args.rows, args.tokens)
        plain = cuda_attention_bias(mask, torch.bfloat16)  # [B, 1, T, S]
        stacked = cuda_attention_bias(mask, torch.bfloat16, groups=HEADS // KV_HEADS)  # [B, 1, G T, S]
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows,
                  "tokens": args.tokens, "heads": f"{HEADS}/{KV_HEADS}/{HEAD_DIM}"}
        for name, form, bias in (("grouped_sdpa", grouped_sdpa, stacked), ("repeat_kv", repeat_kv, plain),
                                 ("enable_gqa", enable_gqa, plain)):
            try:
                result[name] = measure(form, q, k, v, bias)
            except Exception as e:  # noqa: BLE001 - a form this build cannot run is a finding, not a failure
                result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            torch.cuda.empty_cache()
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
