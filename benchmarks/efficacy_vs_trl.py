"""Does our GRPO learn as much as TRL's, and how fast? Same SFT'd tiny model, task, reward, prompts, G,
steps and learning rate through grpo-engine's train(cfg) and TRL's GRPOTrainer; held-out greedy accuracy
of both results (one evaluation function) and the wall time of each GRPO phase.

    python benchmarks/efficacy_vs_trl.py                          # defaults: the full comparison (minutes)
    python benchmarks/efficacy_vs_trl.py --sft-steps 20 --grpo-steps 3 --eval-n 32   # dry run

Pipeline (every knob is a flag):
  (a) a random byte-level Qwen2-shaped checkpoint (make_tiny_checkpoint; ~2.5M params by default);
  (b) supervised warm start (grpo_engine.train.sft.train_sft) on the arithmetic task's train split, target
      "<answer>{answer}</answer>" + EOS, i.e. the completion the task's reward scores 1.1 (format + answer);
  (c) greedy held-out accuracy of the SFT model on --eval-n test problems (disjoint from train);
  (d) our GRPO: grpo_engine.train.loop.train(cfg), config built with load_config(None, overrides), in a child;
  (e) TRL GRPOTrainer from the same SFT checkpoint, same chat-templated prompt strings, same reward (the
      task's reward through safe_reward, as our trainer calls it), in a child;
  (f) greedy held-out accuracy of both results with the same code as (c); (g) a table and one JSON line.
Matched settings: P prompts x G completions per step, temperature 1, beta 0, mu 1, AdamW (betas 0.9/0.99,
eps 1e-8, no weight decay), constant lr, grad-norm clip 1.0, fp32, --max-new completion cap, EOS stops.
GRPO wall time = train(cfg) for ours (it loads the model itself) and GRPOTrainer(...) + .train() for TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))
RESULT_TAG = "RESULT_JSON "
BETAS = (0.9, 0.99)  # our config's default Adam betas; TRL is given the same


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--intermediate", type=int, default=512)
    t = p.add_argument_group("task")
    t.add_argument("--digits", type=int, default=2, help="operands have 1..digits digits")
    t.add_argument("--operations", default="+", help="operators, e.g. '+' or '+*'")
    t.add_argument("--n-train", type=int, default=2000, help="train problems")
    t.add_argument("--eval-n", type=int, default=200, help="held-out test problems for greedy accuracy")
    t.add_argument("--format", default="bare_number", choices=["bare_number", "answer_tag"],
                   help="answer format: just the number (the demo's) or <answer>N</answer>")
    s = p.add_argument_group("SFT warm start")
    s.add_argument("--sft-checkpoint", help="start from this SFT'd checkpoint (e.g. runs/demo/sft) instead of "
                                            "building one")
    s.add_argument("--sft-steps", type=int, default=300)
    s.add_argument("--sft-batch", type=int, default=32)
    s.add_argument("--sft-lr", type=float, default=3e-3)
    g = p.add_argument_group("GRPO (both engines)")
    g.add_argument("--grpo-steps", type=int, default=150)
    g.add_argument("--lr", type=float, default=2e-5)
    g.add_argument("--prompts", type=int, default=8, help="P prompts per step")
    g.add_argument("--group", type=int, default=8, help="G completions per prompt")
    g.add_argument("--max-new", type=int, default=32, help="completion cap (the answer is ~21 tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads everywhere (0 = torch default)")
    p.add_argument("--engines", default="ours,trl", help="comma list: ours, trl")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for our engine, e.g. memory.share_prompt_forward=false (A/B runs)")
    p.add_argument("--work-dir", help="keep checkpoints and runs here (default: a temporary directory)")
    p.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--sft-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def task_options(args) -> dict:
    extractors = ["last_number"] if args.format == "bare_number" else ["answer_tag"]
    return {"digits": args.digits, "operations": list(args.operations), "n_train": args.n_train,
            "n_test": args.eval_n, "seed": args.seed, "format": args.format, "extractors": extractors}


def make_arithmetic(args):
    from grpo_engine.tasks import make_task

    return make_task("arithmetic", **task_options(args))


# ------------------------------------------------------------------------------------------ (a), (b)
def reference_completion(task, example) -> str:
    """The completion the task scores fully correct; checked, so a changed answer format fails loudly."""
    text = task.reference_completion(example)
    result = task.reward(example, text)
    if result.components.get("answer") != 1.0:
        raise ValueError(f"reference completion {text!r} is not scored correct by the task ({result}); the "
                         f"arithmetic task's answer format changed: update reference_completion()")
    return text


def build_sft_checkpoint(args, work: Path) -> tuple[Path, dict]:
    import torch

    from grpo_engine.model.hf_io import load_model, save_model
    from grpo_engine.model.tiny import make_tiny_checkpoint
    from grpo_engine.model.tokenizer import load_tokenizer
    from grpo_engine.train.rollouts import render_prompt
    from grpo_engine.train.sft import SFTConfig, train_sft

    base = make_tiny_checkpoint(work / "base", "qwen2", seed=args.seed, hidden_size=args.hidden,
                                num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate)
    tok, task = load_tokenizer(base), make_arithmetic(args)
    eos = tok.eos_token_ids[0]
    pairs = [(tok.encode(render_prompt(task, tok, ex)), tok.encode(reference_completion(task, ex)) + [eos])
             for ex in task.examples("train")]
    torch.manual_seed(args.seed)
    model = load_model(base)
    t0 = time.perf_counter()
    losses = train_sft(model, pairs, SFTConfig(steps=args.sft_steps, batch_size=args.sft_batch, lr=args.sft_lr,
                                               seed=args.seed), pad_id=tok.pad_token_id)
    info = {"sft_wall_s": time.perf_counter() - t0, "sft_first_loss": losses[0], "sft_last_loss": losses[-1],
            "params": model.num_parameters(), "train_pairs": len(pairs)}
    return save_model(model, work / "sft", tokenizer_dir=base), info


# ------------------------------------------------------------------------------------------ (c), (f)
def greedy_accuracy(model_dir: Path, tokenizer_dir: Path, args) -> float:
    """Share of held-out problems whose greedy completion the task scores answer-correct."""
    import torch

    from grpo_engine.model.hf_io import load_model
    from grpo_engine.model.tokenizer import load_tokenizer
    from grpo_engine.rollout import SamplingParams, generate
    from grpo_engine.tasks.base import safe_reward
    from grpo_engine.train.rollouts import render_prompt

    tok, task = load_tokenizer(tokenizer_dir), make_arithmetic(args)
    examples = list(task.examples("test"))
    model = load_model(model_dir).eval()
    prompts = [tok.encode(render_prompt(task, tok, ex)) for ex in examples]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=args.max_new, stop_token_ids=tok.eos_token_ids)
    with torch.inference_mode():
        out = generate(model, prompts, params, seed=args.seed)
    texts = [tok.decode(c, skip_special_tokens=True) for c in out.completion_ids]  # row i = prompt i (n=1)
    correct = [safe_reward(task, ex, text).components.get("answer", 0.0) == 1.0 for ex, text in zip(examples, texts)]
    return sum(correct) / len(correct)


# ------------------------------------------------------------------------------------------ (d) ours
def ours_child(args) -> dict:
    from grpo_engine.config import load_config
    from grpo_engine.train.loop import train

    overrides = [
        f"seed={args.seed}", f"run_dir={args.out}", f"model.path={args.sft_dir}", "model.device=cpu",
        "memory.precision=fp32", "task.name=arithmetic", f"task.options={json.dumps(task_options(args))}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new}", "rollout.temperature=1.0", "algorithm.beta=0.0",
        "algorithm.mu=1", f"optimizer.lr={args.lr}", f"optimizer.betas=[{BETAS[0]},{BETAS[1]}]",
        "optimizer.weight_decay=0.0", "optimizer.grad_clip=1.0", f"schedule.steps={args.grpo_steps}",
        "schedule.lr_schedule=constant", "schedule.warmup_steps=0", "logging.progress=false",
        "logging.samples_every=0", "checkpoint.every=0", "checkpoint.keep_last=1", "eval.every=0",
        *args.ours_set,
    ]
    cfg = load_config(None, overrides)
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    rewards = [json.loads(line).get("reward_mean") for line in (Path(args.out) / "metrics.jsonl").open()]
    return {"engine": "ours", "grpo_wall_s": wall, "model_dir": str(result.checkpoint / "model"),
            "reward_per_step": [r for r in rewards if r is not None]}


# ------------------------------------------------------------------------------------------ (e) TRL
def completion_text(completion) -> str:
    """TRL passes a string (plain prompts) or a list of messages (conversational prompts)."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def trl_child(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpo_engine.model.tokenizer import load_tokenizer
    from grpo_engine.tasks.base import safe_reward
    from grpo_engine.train.rollouts import render_prompt

    torch.manual_seed(args.seed)
    task, ours_tok = make_arithmetic(args), load_tokenizer(args.sft_dir)
    train = list(task.examples("train"))
    prompts = [render_prompt(task, ours_tok, ex) for ex in train]  # chat template + prefill: same strings
    hf_tok = AutoTokenizer.from_pretrained(args.sft_dir)
    if hf_tok(prompts[0])["input_ids"] != ours_tok.encode(prompts[0]):
        raise RuntimeError("transformers and grpo_engine tokenise the prompt differently; not a fair comparison")

    def task_reward(completions, example_index, **_) -> list[float]:
        return [safe_reward(task, train[i], completion_text(c)).total for c, i in zip(completions, example_index)]

    out = Path(args.out)
    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, fp16=False, seed=args.seed,
        per_device_train_batch_size=args.prompts * args.group,  # TRL counts completions
        num_generations=args.group, max_completion_length=args.max_new, gradient_accumulation_steps=1,
        num_iterations=1, beta=0.0, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        temperature=1.0, max_steps=args.grpo_steps, gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"}, save_strategy="no", report_to=[], logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict({"prompt": prompts, "example_index": list(range(len(train)))})
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=args.sft_dir, reward_funcs=task_reward, args=config, train_dataset=dataset,
                          processing_class=hf_tok)
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.save_model(str(out / "model"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"engine": "trl", "grpo_wall_s": wall, "model_dir": str(out / "model"), "reward_per_step": rewards}


# ------------------------------------------------------------------------------------------ driver
def run_child(argv: list[str], engine: str, sft_dir: Path, out: Path) -> dict:
    """Re-run this file as `--child engine` with the same flags; parse its RESULT_JSON line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", engine, "--sft-dir", str(sft_dir),
           "--out", str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{engine} child failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def reward_trend(rewards: list[float]) -> tuple[float, float]:
    """Mean reward over the first and the last tenth of the steps (at least one step each)."""
    if not rewards:
        return float("nan"), float("nan")
    k = max(1, len(rewards) // 10)
    return statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])


def report(args, sft_info: dict, sft_acc: float, results: dict[str, dict]) -> dict:
    if "reused" in sft_info:
        print(f"SFT checkpoint {sft_info['reused']}: held-out greedy accuracy {sft_acc:.1%} (n={args.eval_n})")
    else:
        print(f"SFT: {sft_info['params']:,} params, {args.sft_steps} steps in {sft_info['sft_wall_s']:.1f}s, "
              f"loss {sft_info['sft_first_loss']:.3f} -> {sft_info['sft_last_loss']:.3f}, "
              f"held-out greedy accuracy {sft_acc:.1%} (n={args.eval_n})")
    rows = [("engine", "accuracy after GRPO", "GRPO wall (s)", "reward first->last 10%")]
    for name, r in results.items():
        first, last = reward_trend(r["reward_per_step"])
        rows.append((name, f"{r['accuracy']:.1%}", f"{r['grpo_wall_s']:.1f}", f"{first:.3f} -> {last:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    summary = {"benchmark": "efficacy_vs_trl", "settings": {k: v for k, v in vars(args).items()
                                                              if k not in ("child", "sft_dir", "out")},
               "sft": sft_info, "sft_accuracy": sft_acc,
               "results": {k: {kk: vv for kk, vv in v.items() if kk != "model_dir"} for k, v in results.items()}}
    if "ours" in results and "trl" in results:
        ours, trl = results["ours"], results["trl"]
        summary["time_ratio"] = ours["grpo_wall_s"] / trl["grpo_wall_s"]
        summary["accuracy_delta"] = ours["accuracy"] - trl["accuracy"]
        summary["targets_met"] = {"accuracy_ours>=trl": ours["accuracy"] >= trl["accuracy"],
                                  "time_ratio<=0.5": summary["time_ratio"] <= 0.5}
        print(f"ours / TRL GRPO wall time {summary['time_ratio']:.3f} (target <= 0.5); accuracy ours - TRL "
              f"{summary['accuracy_delta']:+.1%} (target >= 0)")
    return summary


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.child:
        result = {"ours": ours_child, "trl": trl_child}[args.child](args)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - {"ours", "trl"}:
        raise SystemExit(f"--engines {args.engines!r}: give a comma list of ours, trl")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.sft_checkpoint:
            sft_dir, sft_info = Path(args.sft_checkpoint), {"reused": args.sft_checkpoint}
        else:
            print("SFT warm start ...", file=sys.stderr, flush=True)
            sft_dir, sft_info = build_sft_checkpoint(args, work)
        sft_acc = greedy_accuracy(sft_dir, sft_dir, args)
        results = {}
        for name in engines:
            print(f"GRPO: {name} ...", file=sys.stderr, flush=True)
            results[name] = run_child(argv, name, sft_dir, work / f"grpo_{name}")
            results[name]["accuracy"] = greedy_accuracy(Path(results[name]["model_dir"]), sft_dir, args)
        print(json.dumps(report(args, sft_info, sft_acc, results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
