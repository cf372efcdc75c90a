"""What the Python API is given, turned into what `grpo train` reads: config overrides and files.

- overrides: `rollout__group_size=16`, `{"rollout.group_size": 16}` or `{"rollout": {"group_size": 16}}` become the
  command line's `rollout.group_size=16` and go through the same validation (config/load.py);
- a reward: a function is named by "module:qualname" in task.options.reward_fn (several, with weights, in
  reward_fns) and handed over in process (tasks/custom.py providing_rewards); a built-in verifier's name sets
  task.options.verifier;
- rows (a list of dicts, a `datasets.Dataset`): checked row by row as a data file is (fields, text, the per-row
  and per-file budgets), errors naming the row's index, then written as JSON lines to RUN_DIR/data/train_data.jsonl
  (test_data.jsonl): the run reads, fingerprints (data.json) and resumes from that file like any other, the CLI
  included, and other rows on resume are a data change (refused unless allowed).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import ConfigError
from ..config.load import plain_data
from ..tasks.custom import VERIFIERS, importable_name
from ..tasks.data import FILE_OPTION, DataError, Limits, check_fields, check_text, line_too_long

DATA_DIR = "data"  # RUN_DIR/data/: the rows given in Python, as the run's data files
REQUIRED = ("prompt", "answer")


# ------------------------------------------------------------------------------------------------ overrides
def override_items(overrides: Mapping) -> list[str]:
    """The command line's `key=value` items of keyword overrides: `__` or `.` between a section and its key, a
    mapping value spread into its keys."""
    items = []
    for key, value in overrides.items():
        dotted = str(key).replace("__", ".")
        if isinstance(value, Mapping) and value:
            items += override_items({f"{dotted}.{k}": v for k, v in value.items()})
        else:
            items.append(f"{dotted}={yaml_value(value)}")
    return items


def yaml_value(value) -> str:
    """`value` as the YAML text of an override (16, 1.0e-05, [a, b], {fn: m:f, weight: 0.5}, null)."""
    try:
        text = yaml.safe_dump(plain_data(value), default_flow_style=True, width=1 << 30, allow_unicode=True)
    except yaml.YAMLError:
        raise ConfigError(f"override value {value!r} is not config data (text, numbers, lists, dicts)") from None
    return text.removesuffix("\n").removesuffix("\n...").strip()


# -------------------------------------------------------------------------------------------------- rewards
@dataclass(frozen=True)
class Rewards:
    """A `reward` argument as config overrides and the functions handed over in process."""

    overrides: list[str] = field(default_factory=list)  # task.options.* items
    functions: dict[str, Callable] = field(default_factory=dict)  # name in the config -> the function given
    python_only: list[str] = field(default_factory=list)  # names no other process can import (a notebook's)


def reward_settings(reward) -> Rewards:
    """None (the config's), a verifier name, "module:function", a function, or a list of functions and
    "module:function" names, each alone (weight 1) or as a (function, weight) pair."""
    if reward is None:
        return Rewards()
    if isinstance(reward, str) and reward in VERIFIERS:
        return Rewards(["task.options.verifier=" + reward, "task.options.reward_fn=null",
                        "task.options.reward_fns=null"])
    if isinstance(reward, str) or callable(reward):
        [(name, _)], functions = _named([reward], "reward")
        return Rewards([f"task.options.reward_fn={yaml_value(name)}", "task.options.reward_fns=null"], functions,
                       [n for n in functions if not importable_name(n)])
    if isinstance(reward, (list, tuple)) and reward:
        pairs = [item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0) for item in reward]
        named, functions = _named([fn for fn, _ in pairs], "reward")  # the weights: checked as reward_fns' are
        listed = [{"fn": name, "weight": weight} for (name, _), (_, weight) in zip(named, pairs)]
        return Rewards(["task.options.reward_fn=null", f"task.options.reward_fns={yaml_value(listed)}"], functions,
                       [n for n in functions if not importable_name(n)])
    raise ConfigError(f"reward={reward!r:.80} must be a function fn(example, completion) -> float, a verifier name "
                      f"({', '.join(VERIFIERS)}), \"module:function\", or a list of those (each alone or as a "
                      f"(function, weight) pair)")


def _named(items: list, what: str) -> tuple[list[tuple[str, object]], dict[str, Callable]]:
    """(name, item) of each function or "module:function", and the functions by name. An importable function is
    named as Python imports it; any other callable gets a name no importer takes (`importable_name`)."""
    named, functions = [], {}
    for i, item in enumerate(items):
        if isinstance(item, str):
            if item in VERIFIERS:
                raise ConfigError(f"{what}[{i}]={item!r}: a verifier is the whole reward, not an item of a list; "
                                  f"pass reward={item!r}, or a function that calls it")
            if ":" not in item:
                raise ConfigError(f"{what}={item!r} is neither a verifier ({', '.join(VERIFIERS)}) nor "
                                  f"\"module:function\"")
            named.append((item, item))
            continue
        if not callable(item):
            raise ConfigError(f"{what}[{i}]={item!r:.80} is not a function fn(example, completion) -> float")
        base = name = function_name(item)
        while name in functions and functions[name] is not item:  # two lambdas: two names
            name = f"{base}#{len(functions) + 1}"
        functions[name] = item
        named.append((name, item))
    return named, functions


def function_name(fn: Callable) -> str:
    """"module:qualname" when importing that gives back `fn` itself; else the same text marked so that no process
    imports it ("#object", or a `__main__` / `<lambda>` name, which tasks/custom.py refuses as it is)."""
    module = getattr(fn, "__module__", None) or "__main__"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    name = f"{module}:{qualname}"
    found = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is fn or not importable_name(name):
        return name
    return f"{name}#object"


# ----------------------------------------------------------------------------------------------------- rows
def is_rows(data) -> bool:
    """A list / tuple of rows or a `datasets.Dataset` (recognised without importing datasets)."""
    return isinstance(data, (list, tuple)) or type(data).__module__.split(".")[0] == "datasets"


def rows_of(data, what: str) -> list:
    """The rows of a list or a `datasets.Dataset` (datasets is imported by whoever made it, not here)."""
    if isinstance(data, (list, tuple)):
        return list(data)
    if type(data).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise DataError(f"{what} is a DatasetDict of splits {list(data)}; pass one split, e.g. {what}=ds['train']")
    to_list = getattr(data, "to_list", None)
    if to_list is None:
        raise DataError(f"{what} is a {type(data).__name__}; pass a list of dicts or a datasets.Dataset")
    return to_list()


def jsonl_text(rows: Sequence, what: str, limits: Limits) -> str:
    """The rows as JSON lines, each checked by the data reader's checks of a file's row (tasks/data.py): a dict
    whose `prompt` and `answer` are set, not empty and not longer than a chat template renders, JSON data, Unicode
    text, at most limits.line_kib KiB; all of them at most limits.file_mib MiB. Errors name the row by its index
    (`train_data[3]`)."""
    if not rows:
        raise DataError(f"{what} has no rows; give a list of {{'prompt': ..., 'answer': ...}} dicts")
    lines, size = [], 0
    for i, row in enumerate(rows):
        line = _row_line(row, f"{what}[{i}]", limits)
        size += len(line.encode("utf-8"))
        if size > limits.file_mib << 20:
            raise DataError(f"{what}: the rows up to [{i}] hold more than {limits.file_mib:,} MiB (the limit, "
                            f"{FILE_OPTION}); raise {FILE_OPTION} if it is meant to be this large")
        lines.append(line)
    return "".join(lines)


def _row_line(row, where: str, limits: Limits) -> str:
    if not isinstance(row, Mapping):
        raise DataError(f"{where} is a {type(row).__name__}, expected a dict with fields {list(REQUIRED)}")
    check_fields(row, REQUIRED, where)  # as a file's rows are checked (tasks/data.py)
    try:
        line = json.dumps(dict(row), ensure_ascii=False, allow_nan=False) + "\n"
    except (TypeError, ValueError, RecursionError) as e:
        raise DataError(f"{where}: {e}; every value must be JSON data (text, finite numbers, lists, dicts)") from None
    check_text(row, where)
    if len(line) - 1 > limits.line_kib << 10:
        raise line_too_long(where, limits)
    return line


@dataclass(frozen=True)
class RowsFile:
    """Rows given in Python, checked, and the file under RUN_DIR/data/ the run reads them from."""

    path: Path
    text: str

    def write(self, replace: bool = True) -> Path:
        """Write the file unless it holds these rows already. replace=False: other rows in it (those a run's
        checkpoints were trained on) are a DataError, not overwritten."""
        if self.path.is_file() and self.path.read_text(encoding="utf-8") == self.text:
            return self.path
        if self.path.is_file() and not replace:
            what = self.path.stem
            raise DataError(f"{what} differs from the rows this run's checkpoints were trained on ({self.path}): "
                            f"train(allow_data_change=True) goes on with the new rows, train(overwrite=True) starts "
                            f"over; or choose another run_dir")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(self.text, encoding="utf-8")
        os.replace(tmp, self.path)
        return self.path


def rows_file(data, what: str, run_dir: str | Path, limits: Limits, hashed: bool = False) -> RowsFile:
    """The checked rows and their file: RUN_DIR/data/{what}.jsonl (the run's data, a file that changes with the rows
    as a user's file would), or with `hashed` named by its content's hash (rows evaluated, never trained on)."""
    text = jsonl_text(rows_of(data, what), what, limits)
    name = f"{what}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:16]}" if hashed else what
    return RowsFile(rows_path(run_dir, name), text)


def rows_path(run_dir: str | Path, name: str) -> Path:
    """RUN_DIR/data/{name}.jsonl, absolute (the run resumes from anywhere, the CLI included)."""
    return Path(run_dir).resolve() / DATA_DIR / f"{name}.jsonl"
