"""docs/configuration.md, generated from the fields' metadata (`python -m grpo_engine.config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from .run import Config


def iter_config_docs(cls=Config, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """(dotted_name, type, default, help) of every leaf field, in declaration order."""
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            yield from iter_config_docs(type(value), prefix if f.metadata.get("inline") else f"{prefix}{f.name}.")
            continue
        help_text = f.metadata.get("help", "")
        if "choices" in f.metadata:
            help_text += f" [{' | '.join(f.metadata['choices'])}]"
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        yield prefix + f.name, type_name, value, help_text


def config_docs_markdown() -> str:
    """docs/configuration.md: one table of every field (tests/test_config_docs.py keeps the file in sync)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config tree's field docs (`python -m grpo_engine.config > docs/configuration.md`);",
        "a test fails when this file and grpo_engine/config/ disagree. YAML keys map 1:1 onto these dotted",
        "names, and any of them can be overridden on the command line: `grpo train CONFIG rollout.group_size=16`.",
        "An override merges into a mapping such as `task.options`; `task.options=null` empties it first (switching",
        "`task.name` on the command line: `task.name=countdown task.options=null task.options.n_train=500`).",
        "",
        "| field | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, type_name, default, help_text in iter_config_docs():
        shown = repr(default) if isinstance(default, str) else default
        kind = type_name.replace(" | ", " or ")
        lines.append(f"| `{name}` | {kind} | `{shown}` | {help_text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
