"""Chat templates compiled and rendered the way transformers renders them, in a sandbox bounded in work.

transformers' conventions: a sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`, the
`raise_exception` and `strftime_now` globals, a `tojson` filter that keeps non-ASCII characters, and the special
tokens (bos_token, eos_token, ...) as variables.

A chat template comes with a checkpoint someone hands you: untrusted. jinja2's sandbox keeps it from escaping,
not from working: nested `range(100000)` loops ran for minutes and `{{ 'x' * 200000000 }}` allocated gigabytes.
Here one compile or render may take MAX_SECONDS of wall time and produce MAX_OUTPUT characters; no value it
builds may print larger than MAX_OUTPUT (a list of a million references to one string prints as a million
strings), and all it builds together may not pass MAX_WORK. The hooks (`_BoundedSandbox`,
`_BoundedCodeGenerator`): every loop's iterable checks the deadline per item; every call, filter, `+ * % **`
and `~` checks the deadline or its arguments and, before it allocates, the size of what it builds (repetition,
replace, join, format, ...: model/template_budget.py); every list, tuple or dict literal, `{{ output }}` and
buffered block is size-checked; the output is streamed and counted. Over budget, and on any error in a
template (syntax, undefined, SecurityError, RecursionError, a filter's TypeError), a one-line CheckpointError
that names the template's file.
"""

from __future__ import annotations

import functools
import json
import warnings
from datetime import datetime
from itertools import islice

import jinja2
from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .config import CheckpointError
from .template_budget import (
    ACTIVE_BUDGET,
    HELD,
    LOOP_GUARD,
    MAX_OUTPUT,
    Budget,
    bounded_filter,
    checked_call_args,
    current_budget,
    format_size,
)


class TemplateError(CheckpointError):
    """Raised by a chat template's raise_exception(...): the template refuses the messages."""


def one_line(e, limit: int = 300) -> str:
    return " ".join(str(e).split())[:limit]


@pass_context  # (never called at compile time)
def _loop_guard(context, iterable):
    """Every {% for %}'s iterable: a long one yields through a generator that checks the deadline per item."""
    budget = current_budget()
    budget.tick()
    try:
        if len(iterable) <= 64:
            return iterable
    except TypeError:
        pass
    return _ticking(budget, iterable)


def _ticking(budget: Budget, iterable):
    for item in iterable:
        budget.tick()
        yield item


@pass_context
def _held(context, value):
    """Every list, tuple or dict literal (`_Guards`): none prints larger than MAX_OUTPUT."""
    budget = current_budget()
    budget.tick()
    if type(value) is not str:
        budget.size(value)
    return value


def _finalize(value):
    """Every {{ expression }}: what is printed is at most MAX_OUTPUT characters."""
    if type(value) is not str:
        current_budget().size(value)
    return value


def _bounded_concat(parts) -> str:
    """The output of a macro, {% set %} block, {% filter %} or {% call %} block, joined if under MAX_OUTPUT."""
    parts = parts if isinstance(parts, list) else list(parts)
    if sum(map(len, parts)) > MAX_OUTPUT:
        current_budget().fail("rendered more than 1 MiB")
    return current_budget().charge("".join(parts))


def _raise(message):
    raise TemplateError(f"{current_budget().origin}: {one_line(message)}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if indent is None:
        return json.dumps(x, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    if (len(indent) if isinstance(indent, str) else indent) > 64:
        current_budget().fail("indents tojson by more than 64")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    chunks, out, n = encoder.iterencode(x), [], 0
    while batch := list(islice(chunks, 256)):  # indented: the lines counted as they are made
        n += sum(map(len, batch))
        if n > MAX_OUTPUT:
            current_budget().fail("renders more than 1 MiB with tojson")
        out += batch
    return "".join(out)


class _Guards(NodeTransformer):
    """Every loop's iterable through LOOP_GUARD; every list, tuple or dict literal that is not a constant through
    HELD: `[a, a]` is the one way a template builds a value from references without a hook, and names make
    that exponential (`{% set b = [a, a] %}{% set c = [b, b] %}...`: a value that prints as 2^n `a`s, and
    takes 2^n steps to compare with its like)."""

    def __init__(self, environment):
        self.environment = environment

    def guard(self, name: str, expr: nodes.Expr) -> nodes.Filter:
        return nodes.Filter(expr, name, [], [], None, None, lineno=expr.lineno).set_environment(self.environment)

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = self.guard(LOOP_GUARD, node.iter)
        return node

    def visit_List(self, node):
        node = self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":  # a tuple assigned to
            return node
        try:
            node.as_const()
            return node
        except nodes.Impossible:
            return self.guard(HELD, node)

    visit_Tuple = visit_Dict = visit_List


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator with the guards of `_Guards`, and `~` and chains of `+` through the environment's
    bounded_join and bounded_add."""

    def visit_Template(self, node: nodes.Template, frame=None):
        _Guards(self.environment).visit(node)
        super().visit_Template(node, frame)

    @optimizeconst
    def visit_Add(self, node: nodes.Add, frame) -> None:
        parts = [node.right]
        while isinstance(node.left, nodes.Add):
            node = node.left
            parts.append(node.right)
        self.write("environment.bounded_add((")
        for part in [node.left, *reversed(parts)]:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        join = ("(markup_join if context.eval_ctx.volatile else str_join)" if frame.eval_ctx.volatile else
                "markup_join" if frame.eval_ctx.autoescape else "str_join")
        self.write(f"environment.bounded_join({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox, bounded in time and size (the module's docstring)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})
    concat = staticmethod(_bounded_concat)

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         finalize=_finalize)
        del self.globals["lipsum"]  # lipsum(10**5) runs for many seconds in one call
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.filters["tojson"] = _tojson
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters.update({LOOP_GUARD: _loop_guard, HELD: _held})

    def call_binop(self, context, operator: str, left, right):
        budget = ACTIVE_BUDGET.get() or Budget("chat template")
        if operator == "*" and isinstance(left, int) and not isinstance(right, int):
            left, right = right, left
        if operator == "*" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, int):
            if right > 0 and budget.size(left) * right > MAX_OUTPUT:
                budget.fail("repeats a value past 1 MiB")
        elif operator in ("*", "**") and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            bits = right * left.bit_length() if operator == "**" else left.bit_length() + abs(right).bit_length()
            if bits > 1 << 16:
                budget.fail("computes a number of more than 20000 digits")
        elif operator == "+":
            budget.size(left, right)
        elif operator == "%" and isinstance(left, str) and format_size(budget, left, "%", [right]) > MAX_OUTPUT:
            budget.fail("formats a string past 1 MiB")
        return budget.charge(self.binop_table[operator](left, right))

    def call(self, context, obj, /, *args, **kwargs):
        budget = ACTIVE_BUDGET.get() or Budget("chat template")
        budget.tick()
        if args or kwargs:
            budget.size(*args, *kwargs.values())
            if not isinstance(obj, (Macro, LoopContext)):
                args = checked_call_args(budget, obj, args, kwargs)
        result = super().call(context, obj, *args, **kwargs)
        if type(result) is not str:  # {}.fromkeys(range(1000), a): a thousand references to one value
            budget.size(result)
        return budget.charge(result)

    def wrap_str_format(self, value):
        """str.format / format_map, bounded like `%`."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def bounded(*args, **kwargs):
            budget = current_budget()
            if format_size(budget, value.__self__, "{", [*args, kwargs]) > MAX_OUTPUT:
                budget.fail("formats a string past 1 MiB")
            return budget.charge(wrapped(*args, **kwargs))

        return bounded

    def bounded_add(self, parts: tuple):
        """`a + b + c ...`, one call for a whole chain; strings (the common case) joined at once."""
        for part in parts:
            if type(part) is not str:
                return functools.reduce(lambda a, b: self.call_binop(None, "+", a, b), parts)
        n = sum(map(len, parts))
        if n > 4096:  # (small strings uncounted: they cost less than counting them)
            budget = current_budget()
            if n > MAX_OUTPUT:
                budget.fail("built a string larger than 1 MiB")
            budget.work += n  # (checked at the next tick: every loop step, call, filter and literal)
        return "".join(parts)

    def bounded_join(self, join, parts) -> str:
        """`a ~ b ~ ...`, its parts' printed size checked first."""
        budget = current_budget()
        budget.size(*parts)
        return budget.charge(join(parts))


@functools.cache
def _sandbox() -> _BoundedSandbox:
    return _BoundedSandbox()


def _describe(e: BaseException) -> str:
    """`TypeName: message (template line N)`, on one line."""
    line, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{type(e).__name__}: {one_line(e)}" + (f" (template line {line})" if line else "")


def compile_template(source, origin: str) -> jinja2.Template:
    """`source` compiled in the bounded sandbox; `origin` (the template's file) names it in every error."""
    if not isinstance(source, str):
        raise CheckpointError(f"{origin}: the chat template is a {type(source).__name__}, not a string; fix it")
    if len(source) > MAX_OUTPUT:
        raise CheckpointError(f"{origin}: the chat template is longer than 1 MiB; it is broken or hostile: replace it")
    token = ACTIVE_BUDGET.set(Budget(origin))
    try:
        with warnings.catch_warnings():  # about the template's text (`'\['`) or the code made of it (`{{ 1[0] }}`)
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            return _sandbox().from_string(source)
    except CheckpointError:
        raise
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"{origin}: the chat template does not compile: {one_line(e.message)} (template "
                              f"line {e.lineno}); fix or replace it") from None
    except Exception as e:  # RecursionError (nesting), MemoryError, ...
        raise CheckpointError(f"{origin}: the chat template does not compile: {_describe(e)}; fix or replace it"
                              ) from None
    finally:
        ACTIVE_BUDGET.reset(token)


def render_template(template: jinja2.Template, origin: str, variables: dict) -> str:
    """The template rendered with `variables` within the budget (the module's docstring)."""
    token = ACTIVE_BUDGET.set(Budget(origin))
    try:
        out, n = [], 0
        append = out.append
        for chunk in template.generate(variables):
            n += len(chunk)
            if n > MAX_OUTPUT:
                current_budget().fail("rendered more than 1 MiB")
            append(chunk)
        return "".join(out)
    except CheckpointError:  # (TemplateError is one)
        raise
    except Exception as e:  # UndefinedError, SecurityError, RecursionError, a filter's TypeError, ...
        raise CheckpointError(f"{origin}: the chat template failed: {_describe(e)}; fix the template (or the "
                              f"messages it was given)") from None
    finally:
        ACTIVE_BUDGET.reset(token)
