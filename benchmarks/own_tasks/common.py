"""What the own-task generators share: the command line, distinct seeded rows, the held-out split, the files.

Each generator gives one function, draw(rng) -> Row, and calls main(). Rows are drawn from one
random.Random(seed) until there are n_train + n_test distinct prompts, then shuffled; the first n_test are the
test split, the rest the train split, so the two never share a prompt and the same seed writes the same bytes.
The files are JSON lines the custom task reads (`prompt`, `answer`; `id` and `kind` ride along for reading
results).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Row:
    prompt: str  # the whole user message, the instruction on how to answer included
    answer: str  # the reference answer the verifier compares with
    kind: str  # which template or question type made it


def words(text: str) -> list[str]:
    """The whitespace-separated words of a word-list literal."""
    return text.split()


def distinct_rows(draw: Callable[[random.Random], Row], n: int, rng: random.Random) -> list[Row]:
    """n rows with distinct prompts, in the order drawn; a ValueError when the generator has too few."""
    seen: set[str] = set()
    rows: list[Row] = []
    for _ in range(50 * n):
        row = draw(rng)
        if row.prompt not in seen:
            seen.add(row.prompt)
            rows.append(row)
            if len(rows) == n:
                return rows
    raise ValueError(f"only {len(rows)} distinct prompts in {50 * n} draws; ask for fewer rows")


def write_jsonl(path: Path, rows: list[Row], name: str, split: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            record = {"id": f"{name}-{split}-{i}", "prompt": row.prompt, "answer": row.answer, "kind": row.kind}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def generate(name: str, draw: Callable[[random.Random], Row], out: Path, seed: int = 0, n_train: int = 2000,
             n_test: int = 200) -> tuple[Path, Path]:
    """Write OUT/<name>_train.jsonl and OUT/<name>_test.jsonl; returns their paths."""
    rng = random.Random(seed)
    rows = distinct_rows(draw, n_train + n_test, rng)
    rng.shuffle(rows)  # a kind whose prompts run out late in the draw is as common in test as in train
    out.mkdir(parents=True, exist_ok=True)
    paths = out / f"{name}_train.jsonl", out / f"{name}_test.jsonl"
    write_jsonl(paths[0], rows[n_test:], name, "train")
    write_jsonl(paths[1], rows[:n_test], name, "test")
    return paths


def main(name: str, draw: Callable[[random.Random], Row], doc: str, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for <name>_train.jsonl and _test.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--n-train", type=int, default=2000, help="train rows (default 2000)")
    parser.add_argument("--n-test", type=int, default=200, help="held-out rows (default 200)")
    args = parser.parse_args(argv)
    train, test = generate(name, draw, args.out, args.seed, args.n_train, args.n_test)
    print(f"{train}: {args.n_train} rows\n{test}: {args.n_test} rows")
