"""How well a tools-demo warm start copies operands into its calculator calls and results into its answers.

    python benchmarks/tool_copy_probe.py --steps 1200 --every 200 --heads 2 --rope-theta 1000
    python benchmarks/tool_copy_probe.py --named --restate --rate 0.5 --steps 500 --every 100 --rope-theta 1000

A tiny byte-level model is trained on the tools demo's supervised targets (3-digit multiplication, a teacher
that calls the calculator on `--rate` of the problems; `--named --restate` are the recipe's task options,
without them the call copies the operands' digits). Every
`--every` steps, 128 held-out problems written as tool conversations are scored teacher-forced (argmax at
each target position): the characters of the call's expression, the whole expression, and the final answer copied
whole from the tool's response. docs/tools.md records the results.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from grpo_engine.config import SFTConfig  # noqa: E402
from grpo_engine.model.loading import load_model, load_tokenizer  # noqa: E402
from grpo_engine.model.tiny import make_tiny_checkpoint  # noqa: E402
from grpo_engine.rollout.chat_turns import conversation_ids_and_mask  # noqa: E402
from grpo_engine.sft.trainer import make_sft_batch, train_sft  # noqa: E402
from grpo_engine.sft.warm_start import sft_pairs  # noqa: E402
from grpo_engine.tasks import build_task, render_prompt  # noqa: E402

TASK = dict(template="{a}{op}{b}=", instruction="", system_prompt=None, prefill="", digits=3, operations=["*"],
            format="bare_number", extractors=["last_number"], full_width=True, n_train=20000, n_test=200)


def task_options(named: bool, restate: bool) -> dict:
    """The task options; `named`: operands named a and b, so the call's expression is `a*b`; `restate`: the
    in-head answers restate the problem first (both: configs/tiny_tools.yaml's)."""
    named_options = {"named_operands": True, "template": "a={a} b={b} a{op}b="} if named else {}
    return {**TASK, **named_options, "teacher_restates": restate}


def probe_rows(task, tok, n: int):
    """(prompt ids, forced tool conversation ids + EOS, positions of the call's expression, of the answer)."""
    forced = build_task("arithmetic", {**task.options.__dict__, "teacher_tool_rate": 1.0})
    rows = []
    for ex in task.examples("test")[:n]:
        turns = forced.reference_conversation(ex)
        prompt = tok.encode(render_prompt(task, tok, ex))
        ids = conversation_ids_and_mask(tok, turns)[0] + [tok.eos_token_ids[0]]
        call = turns[0]["content"]
        expr = f"a{ex.op}b" if task.options.named_operands else f"{ex.a}{ex.op}{ex.b}"
        start = len(prompt) + len(tok.encode(call[: call.index(expr)]))
        n_ans = len(tok.encode(str(ex.answer)))
        end = len(prompt) + len(ids) - 1  # the EOS
        rows.append((prompt, ids, range(start, start + len(tok.encode(expr))), range(end - n_ans, end)))
    return rows


def score(model, rows, pad_id: int) -> dict:
    batch = make_sft_batch([(p, c) for p, c, _, _ in rows], pad_id, "cpu")
    with torch.no_grad():
        right = model(batch.input_ids[:, :-1]).argmax(-1) == batch.input_ids[:, 1:]  # [N, T-1]
    chars = [bool(right[i, j - 1]) for i, (_, _, call, _) in enumerate(rows) for j in call]
    return {"expression_chars": sum(chars) / len(chars),  # the 6 digits and the operator
            "operands_whole": sum(all(right[i, j - 1] for j in r[2]) for i, r in enumerate(rows)) / len(rows),
            "answer_whole": sum(all(right[i, j - 1] for j in r[3]) for i, r in enumerate(rows)) / len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--rate", type=float, default=0.2, help="teacher_tool_rate")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-seed", type=int, default=0, help="seed of the tiny model's random weights")
    ap.add_argument("--named", action="store_true", help="named operands: the call is a*b (the recipe's)")
    ap.add_argument("--restate", action="store_true", help="in-head answers restate the problem (the recipe's)")
    args = ap.parse_args()
    from grpo_engine.kernels.threads import fix_threads  # the engine's plan keeps this count

    fix_threads(args.threads)
    task = build_task("arithmetic", {**task_options(args.named, args.restate), "teacher_tool_rate": args.rate})
    with tempfile.TemporaryDirectory() as tmp:
        base = make_tiny_checkpoint(tmp, "qwen2", seed=args.init_seed, hidden_size=args.hidden,
                                    num_hidden_layers=args.layers,
                                    num_attention_heads=args.heads, num_key_value_heads=2,
                                    intermediate_size=2 * args.hidden, rope_theta=args.rope_theta)
        model, tok = load_model(base), load_tokenizer(base)
    rows, results, t0 = probe_rows(task, tok, 128), [], time.perf_counter()

    def on_step(step: int, loss: float) -> None:
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            results.append({"step": step + 1, "seconds": round(time.perf_counter() - t0, 1), "loss": round(loss, 3),
                            **score(model, rows, tok.pad_token_id)})
            print(results[-1], flush=True)

    train_sft(model, sft_pairs(task, tok, task.examples("train")), SFTConfig(steps=args.steps, batch_size=args.batch,
              lr=args.lr), pad_id=tok.pad_token_id, on_step=on_step)
    print(json.dumps({"settings": vars(args), "results": results}))


if __name__ == "__main__":
    main()
