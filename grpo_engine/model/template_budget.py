"""What one compile or render of a chat template may spend (model/chat_template.py's sandbox charges it): the
budget, and upper bounds of what the operations that can multiply their input (repetition, replace, join,
format, indent, batch, ...) would build, checked before they allocate.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, MappingView
from contextvars import ContextVar
from itertools import chain
from time import perf_counter

from jinja2.utils import Namespace

from .config import CheckpointError

MAX_OUTPUT = 1 << 20  # characters a render may produce; also the printed size any value it builds may have
MAX_WORK = 32 << 20  # characters and references one render (or compile) may allocate in all
MAX_SECONDS = 1.0  # wall time of one render (or compile)
MAX_DEPTH = 64  # nesting of the values a template builds
MAX_ITEMS = 100_000  # items a filter that works per item in Python may be given (jinja2's own range limit)
LOOP_GUARD, HELD = "_bounded_loop", "_bounded_value"  # filters chat_template.py wraps loops and literals in
ACTIVE_BUDGET: ContextVar[Budget | None] = ContextVar("chat_template_budget", default=None)


class Budget:
    """What one compile or render of a chat template may still spend; the sandbox's hooks charge it."""

    def __init__(self, origin: str):
        self.origin, self.deadline, self.work, self.weights = origin, perf_counter() + MAX_SECONDS, 0, {}
        self.namespaces = 0  # namespaces walked: a value that holds one may change, so is not memoised

    def fail(self, what: str):
        raise CheckpointError(f"{self.origin}: the chat template {what} (a template may render 1 MiB in "
                              f"{MAX_SECONDS:g} s); it is broken or hostile: replace it")

    def tick(self):
        if perf_counter() > self.deadline:
            self.fail(f"ran for more than {MAX_SECONDS:g} s")
        if self.work > MAX_WORK:
            self.fail(f"built more than {MAX_WORK >> 20} Mi characters of values")

    def charge(self, value):
        """`value`, a hook's result, counted (characters or references) against MAX_WORK."""
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.work += len(value)
            if self.work > MAX_WORK:
                self.fail(f"built more than {MAX_WORK >> 20} Mi characters of values")
        return value

    def size(self, *values) -> int:
        """The printed size of `values` (what str() or tojson of them allocates), at most MAX_OUTPUT."""
        total = 0
        for v in values:
            total += len(v) if type(v) is str else self._weight(v, 0)
            if total > MAX_OUTPUT:
                self.fail("built a value larger than 1 MiB")
        return total

    def _weight(self, x, depth: int) -> int:
        """Printed size, memoised per object for the render (the objects held, so that ids stay unique)."""
        kind = type(x)
        if kind is str or kind is bytes:
            return len(x)
        if x is None or kind is int or kind is float or kind is bool:
            return 8
        hit = self.weights.get(id(x))
        if hit is not None:
            return hit[1]
        if depth > MAX_DEPTH:
            self.fail(f"nested values more than {MAX_DEPTH} deep")
        namespaces = self.namespaces
        if kind is dict or kind is list or kind is tuple:
            w = self._sum(chain.from_iterable(x.items()) if kind is dict else x, depth)
        elif isinstance(x, (str, bytes, int, float)):  # Markup, an IntEnum, ...
            return len(x) if isinstance(x, (str, bytes)) else 8
        elif isinstance(x, Namespace):  # mutable: {% set ns.x = ... %}
            self.namespaces += 1
            return self._sum(chain.from_iterable(x._Namespace__attrs.items()), depth)
        elif isinstance(x, (Mapping, list, tuple, set, frozenset, MappingView)):
            w = self._sum(chain.from_iterable(x.items()) if isinstance(x, Mapping) else x, depth)
        else:  # Undefined, Macro, LoopContext, a generator, ...: a short repr
            return 64
        if self.namespaces == namespaces:
            self.weights[id(x)] = (x, w)
        return w

    def _sum(self, items, depth: int) -> int:
        w = 2
        for item in items:
            kind = type(item)
            if kind is str:
                w += 4 + len(item)
            elif item is None or kind is int or kind is float or kind is bool:
                w += 12
            else:
                w += 4 + self._weight(item, depth + 1)
                if w > MAX_OUTPUT:
                    self.fail("built a value larger than 1 MiB")
        if w > MAX_OUTPUT:
            self.fail("built a value larger than 1 MiB")
        return w


def current_budget() -> Budget:
    """The running render's budget (outside one, a fresh budget per operation: sizes are still bounded)."""
    return ACTIVE_BUDGET.get() or Budget("chat template")


def _check_ints(budget: Budget, values, where: str):
    for v in values:
        if isinstance(v, int) and not -MAX_OUTPUT <= v <= MAX_OUTPUT:
            budget.fail(f"passes a number beyond ±{MAX_OUTPUT} to {where}")


def format_size(budget: Budget, fmt, marker: str, values) -> int:
    """An upper bound of `fmt % values` / `fmt.format(*values)`: each field at most the largest value, padded
    to at most the largest number in the format string."""
    items = [x for v in values for x in (v.values() if isinstance(v, Mapping) else
                                         v if isinstance(v, tuple) else (v,))]
    numbers = re.findall(r"\d+", str(fmt))
    if any(len(d) > 7 for d in numbers):
        budget.fail("formats with a width beyond 1 MiB")
    pad = max(map(int, numbers), default=0)
    return len(fmt) + str(fmt).count(marker) * (max(map(budget.size, items), default=0) + pad)


def _method_size(budget: Budget, s, name: str, args, kwargs) -> int:
    """An upper bound of what a str (bytes) method that can multiply its input (replace, join, ...) returns."""
    if name == "replace" and len(args) >= 2:
        old, new, count = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1)
        hits = len(s) + 1 if not old else s.count(old)
        return len(s) + (hits if count < 0 else min(hits, count)) * max(len(new) - len(old), 0)
    if name == "join" and args:
        return budget.size(args[0]) + len(s) * len(args[0])
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * (tab if isinstance(tab, int) else 0)
    if name == "translate" and args and isinstance(args[0], Mapping):
        return len(s) * max([budget.size(v) for v in args[0].values()] + [1])
    return 0


def checked_call_args(budget: Budget, obj, args: tuple, kwargs: dict) -> tuple:
    """A function's or method's arguments checked (numbers; str methods that multiply); join's iterable listed."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    _check_ints(budget, [*args, *kwargs.values()], name or "a function")
    if isinstance(owner, (str, bytes)):
        if name == "join" and args and not isinstance(args[0], (list, tuple)):
            args = (list(args[0]), *args[1:])
        if _method_size(budget, owner, name, args, kwargs) > MAX_OUTPUT:
            budget.fail(f"builds more than 1 MiB with {type(owner).__name__}.{name}")
    return args


def _replace_size(s, old, new, count=None) -> int:
    return _method_size(current_budget(), str(s), "replace", (str(old), str(new), -1 if count is None else count), {})


def _wordwrap_size(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True) -> int:
    s = str(s)
    return len(s) + (len(s.split()) + len(s) // max(int(width), 1) + 1) * len(wrapstring or "\n")


# Filters that can build far more than they are given, and an upper bound of what each builds (called with the
# filter's own arguments, the pass_* one left out); join's iterable is made a list first (`bounded_filter`).
FILTER_SIZES = {
    "replace": _replace_size,
    "join": lambda value, d="", attribute=None: current_budget().size(value) + len(str(d)) * len(value),
    "indent": lambda s, width=4, first=False, blank=False: len(str(s)) + (str(s).count("\n") + 1) * (
        width if isinstance(width, int) else len(str(width))),
    "format": lambda value, *args, **kwargs: format_size(current_budget(), str(value), "%", [kwargs or args]),
    "wordwrap": _wordwrap_size,
    "batch": lambda value, linecount, fill_with=None: linecount * (current_budget().size(fill_with) + 4),
    "slice": lambda value, slices, fill_with=None: slices * (current_budget().size(fill_with) + 32),
}
# Filters given arguments that work per item in Python (an attribute, a test, a filter): at most MAX_ITEMS items
ITEMWISE = frozenset(("dictsort", "groupby", "join", "map", "max", "min", "reject", "rejectattr", "select",
                      "selectattr", "sort", "sum", "unique"))
# Filters that do not turn their input into one string (the others have its printed size checked first)
STRUCTURAL = frozenset(("abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby", "int",
                        "items", "last", "length", "list", "map", "max", "min", "random", "reject", "rejectattr",
                        "reverse", "round", "select", "selectattr", "slice", "sort", "sum", "unique"))


def bounded_filter(name: str, func):
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # the context / environment argument
    checked, stringifies = name in FILTER_SIZES or name in ITEMWISE, name not in STRUCTURAL

    @functools.wraps(func)
    def run(*args, **kwargs):
        budget = ACTIVE_BUDGET.get() or Budget("chat template")
        if perf_counter() > budget.deadline or budget.work > MAX_WORK:
            budget.tick()
        if checked or kwargs or len(args) > skip + 1:
            args = _filter_args(budget, name, args, skip, kwargs)
        if stringifies and len(args) > skip and type(args[skip]) is not str:
            budget.size(args[skip])
        return budget.charge(func(*args, **kwargs))

    return run


def _filter_args(budget: Budget, name: str, args: tuple, skip: int, kwargs: dict) -> tuple:
    """A filter's arguments besides its value checked (numbers, sizes, FILTER_SIZES); join's iterable listed."""
    data = list(args[skip:])
    _check_ints(budget, [*data[1:], *kwargs.values()], f"the {name} filter")
    budget.size(*data[1:], *kwargs.values())
    if name in ITEMWISE and data:  # Python work per item (sandboxed attribute look-ups), no tick inside
        data[0] = data[0] if isinstance(data[0], (list, tuple, str, dict)) else list(data[0])
        if len(data[0]) > MAX_ITEMS:
            budget.fail(f"applies the {name} filter to more than {MAX_ITEMS} items")
    if name == "sum" and not isinstance(kwargs.get("start", data[2] if len(data) > 2 else 0), (int, float)):
        budget.fail("sums values that are not numbers")
    if name in FILTER_SIZES and FILTER_SIZES[name](*data, **kwargs) > MAX_OUTPUT:
        budget.fail(f"builds more than 1 MiB with the {name} filter")
    return (*args[:skip], *data)
