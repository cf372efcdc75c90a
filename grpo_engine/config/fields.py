"""Field helpers of the config tree: one-line docs and choices as dataclass field metadata.

Every field of every section carries `metadata={"help": ...}` (and `"choices"` where the value is one of a
few names): the single documentation mechanism, read by docs.py for docs/configuration.md. Sections check
their own values in `__post_init__` with `require` / `one_of`, which raise ValueError naming the dotted field;
load.py turns those into ConfigError with the file or override that set them.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem; the message names the field, the source and the fix."""


def option(default: Any, help: str, choices: tuple[str, ...] | None = None):
    """A dataclass field with its one-line doc (and allowed values) attached."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda v=default: copy.deepcopy(v), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls, help: str):
    """A nested section field, built fresh per instance."""
    return field(default_factory=cls, metadata={"help": help})


def inline(cls, help: str):
    """A nested section whose fields are written at its parent's level (algorithm.beta, not
    algorithm.policy_loss.beta): load.py moves them under it, docs.py lists them there."""
    return field(default_factory=cls, metadata={"help": help, "inline": True})


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok: a user-controlled value is out of range."""
    if not ok:
        raise ValueError(message)


def one_of(name: str, value: Any, choices: tuple, what: str | None = None) -> None:
    """`value` must be one of `choices`; the error names the field, the choices and the closest one."""
    if value in choices:
        return
    hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    if what:
        raise ValueError(f"{name}: unknown {what} {value!r}; choose one of {sorted(map(str, choices))}{did}")
    raise ValueError(f"{name}={value!r} is not one of {', '.join(map(str, choices))}{did}")
