"""Does the multiple-choice task's wording decide whether the model ties an option to its letter?

    python benchmarks/own_tasks/choice_wordings.py --model PATH.gguf [--data data/own/choice_test.jsonl]

Rewrites the instruction line of every held-out row of make_choice.py's test file under ten other wordings (eight
with the options on their own lines, as the task writes them; two with the options on the question's line), then
scores the starting model greedily on each with `grpo eval` and the choice verifier. Prints one row per wording:
the accuracy, how many replies open by copying the first option's line ("A) ..."), and the letter answered most.
The answers stay the same letters: only how the question asks changes.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_choice import INSTRUCTION  # noqa: E402

ON_THEIR_LINES = ["Reply with the answer, then its letter.", "Reply with just the answer.",
                  "Say which option is right, then give its letter (A, B, C or D).",
                  "Think about each option, then reply with the letter (A, B, C or D) of the right one.",
                  "Reply with just the right option's text, not its letter.",
                  "Reply with the right word or number only.",
                  "Which one is it? Reply with one word.", "Which letter is right?"]
ON_ONE_LINE = [INSTRUCTION, "Answer: the letter of the right option."]


def reworded(prompt: str, instruction: str, one_line: bool) -> str:
    """The row's question and options under another instruction; with one_line, '(A) x (B) y ...' after the stem."""
    lines = prompt.split("\n")
    stem, options = lines[0], lines[1:5]  # "A) 17", ...
    if one_line:
        return f"{stem} {' '.join(f'({o[0]}) {o[3:]}' for o in options)}\n{instruction}"
    return "\n".join([stem, *options, instruction])


def score(model: str, rows: list[dict], folder: Path, name: str) -> dict:
    """Greedy `grpo eval` of the rows as a custom task's test split; its per-problem report."""
    path, out = folder / f"{name}.jsonl", folder / f"{name}.out.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    subprocess.run(["grpo", "eval", model, "--task", "custom", "--data", str(path), "--task-option",
                    f"test_path={path}", "--task-option", "verifier=choice", "--temperature", "0", "--max-new", "96",
                    "--max-examples", str(len(rows)), "--device", "cpu", "--out", str(out), "--overwrite"],
                   check=True, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="SmolLM2-135M-Instruct GGUF or HF directory")
    parser.add_argument("--data", type=Path, default=Path("data/own/choice_test.jsonl"))
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    wordings = [(w, False) for w in ON_THEIR_LINES] + [(w, True) for w in ON_ONE_LINE]
    print("| options | instruction | accuracy | replies opening 'A)' | letter answered most |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (instruction, one_line) in enumerate(wordings):
            variant = [dict(r, prompt=reworded(r["prompt"], instruction, one_line)) for r in rows]
            problems = score(args.model, variant, Path(tmp), f"w{i}")["problems"]
            replies = [p["samples"][0] for p in problems]
            right = sum(s["correct"] for s in replies)
            copied = sum(s["text"].lstrip().startswith("A)") for s in replies)
            letter, count = collections.Counter(s["answer"] for s in replies).most_common(1)[0]
            print(f"| {'one line' if one_line else 'own lines'} | {instruction} | {right}/{len(replies)} | {copied} | "
                  f"{letter} ({count}) |", flush=True)


if __name__ == "__main__":
    main()
