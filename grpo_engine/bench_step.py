"""`grpo bench step`: seconds per GRPO step (generate P x G, fixed length, score, one update) and peak RSS.

The step runs the trainer's own phases (generate with the policy weights, advantages, token-budget
micro-batched update through rl.policy_loss, AdamW step); prompts are fixed token ids and EOS is never a
stop token, so every completion has exactly --max-new tokens, the same work TRL is given in
benchmarks/step_vs_trl.py.
"""

from __future__ import annotations

import json
import resource
import statistics
import time


def add_bench_step_parser(sub) -> None:
    p = sub.add_parser("step", help="time one training step")
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--prompts", type=int, default=4, help="P prompts per step")
    p.add_argument("--group", type=int, default=8, help="G completions per prompt")
    p.add_argument("--max-new", type=int, default=64, help="completion length (fixed: EOS does not stop)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--steps", type=int, default=3, help="steps timed; the median excludes the first")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--chunk-size", type=int, default=1024,
                   help="tokens per log-prob chunk (memory.logprob_chunk_size): peak memory ~ chunk x vocab")
    p.add_argument("--optimizer", default="adamw_fused",
                   help="optimizer.name (default adamw_fused: torch's fused AdamW, transformers' default too)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=_run)


def _run(args) -> int:
    result = bench_step(args.model, prompts=args.prompts, group=args.group, max_new=args.max_new,
                        prompt_len=args.prompt_len, steps=args.steps, micro_batch_tokens=args.micro_batch_tokens,
                        threads=args.threads, chunk_size=args.chunk_size, optimizer=args.optimizer)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


def bench_step(model_dir: str, *, prompts: int, group: int, max_new: int, prompt_len: int, steps: int,
               micro_batch_tokens: int, threads: int = 0, chunk_size: int = 1024,
               optimizer: str = "adamw_fused") -> dict:
    import torch

    from .model.hf_io import load_model
    from .rl.advantages import compute_advantages
    from .rl.losses import LossConfig
    from .rollout import SamplingParams, generate
    from .train.batching import build_rollout_batch
    from .train.optim import OptimizerConfig, build_optimizer
    from .train.update import accumulate_gradients, clip_and_check

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = load_model(model_dir)
    opt = build_optimizer(model.parameters(), OptimizerConfig(name=optimizer, lr=1e-6))
    loss_cfg = LossConfig(loss="grpo", beta=0.0)  # GRPO clip loss, one pass (mu = 1), no reference
    vocab = min(model.config.vocab_size, 256)
    g = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    params = SamplingParams(n=group, temperature=1.0, max_new_tokens=max_new, stop_token_ids=[])
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        model.eval()
        out = generate(model, prompt_ids, params, seed=step)
        # reward: fraction of even token ids (cheap, varies across completions)
        rewards = torch.tensor([sum(t % 2 == 0 for t in c) / len(c) for c in out.completion_ids])
        adv = compute_advantages(rewards.view(prompts, group).double()).advantages.reshape(-1).float()
        batch = build_rollout_batch([prompt_ids[i] for i in out.prompt_index], out.completion_ids, out.logprobs,
                                    adv, [True] * len(adv), pad_id=0)
        model.train()
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(model, batch, loss_cfg, micro_batch_tokens, temperature=1.0, chunk_size=chunk_size)
        clip_and_check(model, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    tail = times[1:] or times
    return {
        "engine": "grpo-engine",
        "sec_per_step": statistics.median(tail),
        "step_times": times,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "prompts": prompts, "group": group, "max_new_tokens": max_new, "prompt_len": prompt_len,
        "params": model.num_parameters(), "threads": torch.get_num_threads(), "optimizer": type(opt).__name__
        + (" (fused)" if opt.defaults.get("fused") else ""), "micro_batch_tokens": micro_batch_tokens,
        "chunk_size": chunk_size,
    }
