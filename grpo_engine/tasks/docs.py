"""The built-in tasks' sections of docs/tasks.md, generated from the task options' field metadata: `python -m
grpo_engine.tasks.docs` rewrites them between the file's markers; the prose around them is written in the file."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from . import TASKS

BEGIN = "<!-- the task sections below are generated from grpo_engine/tasks/ by `python -m grpo_engine.tasks.docs` -->"
END = "<!-- end of the generated task sections -->"

EXAMPLES = {
    "arithmetic": "task:\n  name: arithmetic\n  options:\n    digits: 2\n    operations: [\"+\"]",
    "countdown": "task:\n  name: countdown\n  data_path: data/countdown/train.parquet  # or none: generated",
    "gsm8k": "task:\n  name: gsm8k\n  data_path: data/gsm8k/main  # train-*.parquet and test-*.parquet",
    "math": "task:\n  name: math\n  data_path: data/math500        # needs grpo-engine[math] (math-verify)",
    "custom": ("task:\n  name: custom\n  options:\n    data_path: my_problems.jsonl  # one {\"prompt\", \"answer\"} "
               "per line\n    verifier: numeric  # or choice | word | exact | math; or reward_fn: my_module:my_reward"),
}


def tasks_docs_markdown() -> str:
    """One section per task in TASKS: its module's first paragraph, its options' table and a config example."""
    lines = []
    for name, spec in TASKS.items():
        lines += [f"## {name}", ""]
        module_doc = __import__(spec.task.__module__, fromlist=["x"]).__doc__ or ""
        lines += [module_doc.strip().split("\n\n")[0], "", "| option | default | meaning |", "| --- | --- | --- |"]
        for f in dataclasses.fields(spec.options):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = repr(default).replace("|", "/")
            lines.append(f"| `{f.name}` | `{shown}` | {f.metadata.get('help', '').replace('|', '/')} |")
        lines += ["", "```yaml", EXAMPLES[name], "```", ""]
    return "\n".join(lines)


def generated_part(text: str) -> str:
    """The text between docs/tasks.md's markers."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def with_generated_part(text: str) -> str:
    """docs/tasks.md's text with the part between its markers generated afresh."""
    before, rest = text.split(BEGIN, 1)
    return f"{before}{BEGIN}\n\n{tasks_docs_markdown()}\n{END}{rest.split(END, 1)[1]}"


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/tasks.md")
    path.write_text(with_generated_part(path.read_text()))
