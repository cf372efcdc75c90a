"""What in a config may run code (docs/reliability.md, "What is data and what may run code").

A config is data. A few keys name code to import and call, as "module:function": CODE_KEYS. Such a key runs
when the config is the user's own (the file and overrides named on the command line, a Config built in Python).
When it comes from a config.yaml a run stored (a run directory's or checkpoint's, read by `grpo eval`,
`grpo generate`, `grpo export` and `grpo train --resume`), someone else may have written it: it runs only when
the user names it for that call, `--allow-code MODULE:FUNC`.

How: `config_from_yaml_text` (the reader of stored configs) marks the values of CODE_KEYS as StoredCode, a str
that knows the file it came from, and the one place that imports code by name (tasks/custom.py:
import_reward_fn) calls `check_code` first. What the user allowed is scoped to the command (`allowing_code`).
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from .fields import ConfigError

# Every config key whose value names code to import ("module:function"). Tools are built-in names, not code.
CODE_KEYS = ("task.options.reward_fn", "task.options.reward_fns")  # reward_fns: a list of names or {fn, weight}
ALLOW_FLAG = "--allow-code"
CODE_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")

_ALLOWED: ContextVar[frozenset[str]] = ContextVar("grpo_allowed_code", default=frozenset())


class StoredCode(str):
    """A "module:function" value read from a stored config, not written by the user: `key` and `source` (the
    file) say where it came from. Compares and hashes as the plain string."""

    key: str
    source: str

    def __new__(cls, value: str, key: str, source: str) -> StoredCode:
        self = super().__new__(cls, value)
        self.key, self.source = key, source
        return self

    def __reduce__(self):
        return StoredCode, (str(self), self.key, self.source)


def _code_slots(cfg) -> Iterator[tuple[dict | list, str | int, str]]:
    """(the dict or list holding it, its name or index, the dotted key) of each "module:function" string under a key
    of CODE_KEYS in `cfg`: the key's own string value, or each item of its list (a string, or a mapping's `fn`)."""
    for key in CODE_KEYS:
        *parents, leaf = key.split(".")
        node = cfg
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else getattr(node, name, None)
        value = node.get(leaf) if isinstance(node, dict) else None
        if isinstance(value, str):
            yield node, leaf, key
        for i, item in enumerate(value if isinstance(value, list) else ()):
            if isinstance(item, str):
                yield value, i, f"{key}[{i}]"
            elif isinstance(item, dict) and isinstance(item.get("fn"), str):
                yield item, "fn", f"{key}[{i}].fn"


def mark_stored_code(cfg, source: str):
    """`cfg`, read from the stored config `source`, with each value of CODE_KEYS as a StoredCode (in place)."""
    for node, leaf, key in _code_slots(cfg):
        node[leaf] = StoredCode(node[leaf], key, source)
    return cfg


def code_values(cfg) -> list[str]:
    """Every "module:function" value under CODE_KEYS in `cfg` (StoredCode ones marked as such)."""
    return [node[leaf] for node, leaf, _ in _code_slots(cfg)]


def unmarked(cfg):
    """A copy of `cfg` with plain strings for its StoredCode values, to be written out (OmegaConf refuses a str
    subclass; read back, a stored file is marked again)."""
    cfg = copy.deepcopy(cfg)
    for node, leaf, _ in _code_slots(cfg):
        node[leaf] = str(node[leaf])
    return cfg


def check_code(spec: str) -> None:
    """Called before `spec` ("module:function") is imported: a value from a stored config is refused unless the
    user allowed it for this command (`--allow-code`); the user's own values pass."""
    if isinstance(spec, StoredCode) and str(spec) not in _ALLOWED.get():
        raise ConfigError(f"{spec.key}={str(spec)!r} in {spec.source} names code to import and run, and a stored "
                          f"config is data: if you trust where it came from, pass {ALLOW_FLAG} {spec}")


@contextmanager
def allowing_code(specs: Iterable[str]) -> Iterator[None]:
    """Within this block, the stored "module:function" values `specs` may be imported (one command's
    `--allow-code` flags)."""
    token = _ALLOWED.set(frozenset(specs))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def allow_code_arg(text: str) -> str:
    """argparse type of `--allow-code`: MODULE:FUNC."""
    if not CODE_SPEC.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} must look like MODULE:FUNC, e.g. {ALLOW_FLAG} my_rewards:score")
    return text.strip()


def add_allow_code_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """`--allow-code MODULE:FUNC` (repeatable) on a command that reads `what` (a stored config)."""
    parser.add_argument(ALLOW_FLAG, dest="allow_code", action="append", default=[], type=allow_code_arg,
                        metavar="MODULE:FUNC",
                        help=f"let {what} import and run this function (its {', '.join(CODE_KEYS)}); repeatable. "
                             f"A stored config is data: without this flag a key in it that names code is refused")
