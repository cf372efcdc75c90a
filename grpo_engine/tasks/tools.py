"""Tools a model may call mid-trajectory: declaring them, parsing calls out of model text, running them.

Model output is untrusted, so every step here is bounded and none raises on bad input:

* parsing (`parse_tool_calls`) looks for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (the Qwen2.5 / Qwen3 / Hermes form; Llama 3's `"parameters"` key is accepted for `"arguments"`). A block
  longer than `max_chars`, JSON nested deeper than `max_depth`, a `<tool_call>` inside a block, an
  unterminated block, bad JSON or a wrong shape, and every block past `max_calls`, becomes a counted error
  message instead of a call. The depth is checked by a scan before `json.loads`, whose recursion would
  otherwise be the bound;
* running (`ToolSet.run`) checks the arguments against the tool's parameters, then calls it in a daemon
  thread joined with a timeout: a raising tool and a hanging tool both give an error message for the model
  and a counted error. Python cannot stop a thread, so a hung call keeps its thread; at most
  `MAX_ABANDONED_THREADS` may be hung at once, after which calls are refused (also a counted error);
* results are cut to `max_result_chars` before they go back to the model.

A tool is a decorated function (see `tool`); `BUILTIN_TOOLS` has `calculator` and `check_countdown`, both on
the safe arithmetic evaluator of tasks/expressions.py (no eval).
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .countdown import check_equation
from .expressions import evaluate_arithmetic

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 2048  # characters between the tags of one call
MAX_JSON_DEPTH = 5  # nesting of {} / [] in one call: call object, arguments, then three levels of values
MAX_CALLS_PER_TURN = 4
MAX_RESULT_CHARS = 1024
DEFAULT_TIMEOUT_S = 2.0
MAX_ABANDONED_THREADS = 8  # hung tool threads tolerated before further calls are refused
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict}


class ToolError(Exception):
    """Raised by a tool for a bad request (e.g. an invalid expression): its message goes to the model."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    """What one turn's text asked for, block by block in the order written: a well-formed call, or the
    message saying why the block was rejected. The results go back in this order, so the model can match
    each result to its call."""

    blocks: list[ToolCall | str]

    @property
    def calls(self) -> list[ToolCall]:
        return [b for b in self.blocks if isinstance(b, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [b for b in self.blocks if isinstance(b, str)]

    @property
    def found(self) -> bool:
        return bool(self.blocks)


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str  # the text the model sees
    error: str | None = None  # None, or the kind: unknown_tool, bad_arguments, tool_error, exception, timeout, refused


@dataclass(frozen=True)
class Tool:
    """A callable the model may use: its name, what it does, its JSON-schema parameters, and the function."""

    name: str
    description: str
    parameters: dict[str, Any]  # {"type": "object", "properties": {...}, "required": [...]}
    fn: Callable[..., Any] = field(repr=False)
    takes_variables: bool = False  # fn has a keyword-only `variables`: the environment's named values

    def declaration(self) -> dict[str, Any]:
        """The OpenAI-style declaration chat templates take in `tools=`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """Full JSON schema from either a schema or the shorthand {"x": "integer", "y": {"type": ..., ...}}."""
    if parameters.get("type") == "object" and "properties" in parameters:
        return {"required": list(parameters["properties"]), **parameters}
    props = {k: {"type": v} if isinstance(v, str) else dict(v) for k, v in parameters.items()}
    for name, spec in props.items():
        if spec.get("type") not in _JSON_TYPES:
            raise ValueError(f"parameter {name!r}: type must be one of {sorted(_JSON_TYPES)}, got {spec.get('type')!r}")
    return {"type": "object", "properties": props, "required": list(props)}


def tool(description: str, parameters: dict[str, Any], name: str | None = None) -> Callable[[Callable], Tool]:
    """Decorator: `@tool("Add two integers.", {"a": "integer", "b": "integer"})` over `def add(a, b)` makes
    a Tool named `add`. The function returns anything JSON-serialisable (or a str) and raises ToolError for a
    request it refuses. A keyword-only parameter `variables` (never shown to the model) receives the current
    problem's named values (`Task.tool_variables`), e.g. for the calculator's `a*b`."""

    def wrap(fn: Callable) -> Tool:
        schema = _schema(parameters)
        kw = inspect.signature(fn).parameters.get("variables")
        takes = kw is not None and kw.kind is inspect.Parameter.KEYWORD_ONLY
        if takes and "variables" in schema["properties"]:
            raise ValueError(f"tool {name or fn.__name__!r}: 'variables' is the environment's keyword-only "
                             "argument; rename the model-facing parameter")
        return Tool(name or fn.__name__, description, schema, fn, takes)

    return wrap


# ------------------------------------------------------------------------------------------------ parsing


def json_depth(text: str) -> int:
    """Deepest {} / [] nesting outside JSON strings, in one linear scan (no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return deepest


def _load_json(text: str, max_chars: int, max_depth: int) -> tuple[Any, str | None]:
    """json.loads behind the size and depth bounds -> (value, None) or (None, why not)."""
    if len(text) > max_chars:
        return None, f"tool call is {len(text)} characters, more than the limit of {max_chars}"
    if json_depth(text) > max_depth:
        return None, f"tool call JSON is nested deeper than {max_depth} levels"
    try:
        return json.loads(text), None
    except ValueError as e:
        return None, f"tool call is not valid JSON ({str(e)[:120]})"


def _parse_one(body: str, max_chars: int, max_depth: int) -> ToolCall | str:
    """One block's text -> a call, or the error message."""
    if OPEN in body:
        return "nested <tool_call> inside a tool call"
    obj, error = _load_json(body, max_chars, max_depth)
    if error is not None:
        return error
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'tool call must be a JSON object with a string "name"'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        args, error = _load_json(args, max_chars, max_depth - 1) if args.strip() else ({}, None)
        if error is not None:
            return f'"arguments": {error}'
    if not isinstance(args, dict):
        return '"arguments" must be a JSON object'
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str, max_calls: int = MAX_CALLS_PER_TURN, max_chars: int = MAX_CALL_CHARS,
                     max_depth: int = MAX_JSON_DEPTH) -> ParsedCalls:
    """Every <tool_call>...</tool_call> block of `text`, in order; never raises."""
    blocks: list[ToolCall | str] = []
    pos = text.find(OPEN)
    while pos >= 0:
        if len(blocks) >= max_calls:
            blocks.append(f"more than {max_calls} tool calls in one turn; the rest were ignored")
            break
        end = text.find(CLOSE, pos + len(OPEN))
        if end < 0:
            blocks.append("unterminated <tool_call> (no </tool_call>)")
            break
        blocks.append(_parse_one(text[pos + len(OPEN) : end].strip(), max_chars, max_depth))
        pos = text.find(OPEN, end + len(CLOSE))
    return ParsedCalls(blocks)


# ------------------------------------------------------------------------------------------------ running
_abandoned: list[threading.Thread] = []  # tool threads still running after their timeout (cannot be stopped)
_abandoned_lock = threading.Lock()


def check_arguments(tool: Tool, args: dict[str, Any]) -> str | None:
    """Why `args` do not fit the tool's parameters (missing, unknown, wrong JSON type), or None."""
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in args]
    unknown = [k for k in args if k not in props]
    if missing or unknown:
        return f"missing arguments {missing}, unknown arguments {unknown}; parameters: {list(props)}"
    for key, value in args.items():
        kind = props[key].get("type")
        wanted = _JSON_TYPES.get(kind)
        is_bool_number = isinstance(value, bool) and kind in ("integer", "number")
        if wanted is not None and (is_bool_number or not isinstance(value, wanted)):
            return f"argument {key!r} must be a JSON {kind}, got {type(value).__name__}"
    return None


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _run_bounded(fn: Callable[..., Any], args: dict[str, Any], timeout_s: float) -> tuple[str, str | None]:
    """fn(**args) in a daemon thread joined for timeout_s -> (text, None) or (message, error kind)."""
    box: dict[str, tuple[str, str | None]] = {}

    def target() -> None:
        try:
            box["out"] = (_as_text(fn(**args)), None)
        except ToolError as e:
            box["out"] = (str(e), "tool_error")
        except BaseException as e:  # noqa: BLE001 - a user tool's failure is reported to the model, never raised
            box["out"] = (f"{type(e).__name__}: {e}", "exception")

    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        if len(_abandoned) >= MAX_ABANDONED_THREADS:
            return f"{len(_abandoned)} earlier tool calls are still hung; tool calls are refused", "refused"
    thread = threading.Thread(target=target, daemon=True, name="grpo-tool")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        with _abandoned_lock:
            _abandoned.append(thread)
        return f"the tool did not finish within {timeout_s}s", "timeout"
    return box.get("out", ("the tool returned nothing", "exception"))


class ToolSet:
    """The tools one environment offers, by name; `run` executes a parsed call within the bounds."""

    def __init__(self, tools: list[Tool], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_result_chars: int = MAX_RESULT_CHARS):
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"tool names must be unique, got {[t.name for t in tools]}")
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars

    def declarations(self) -> list[dict[str, Any]]:
        return [t.declaration() for t in self.tools.values()]

    def run(self, call: ToolCall, variables: dict[str, Any] | None = None) -> ToolResult:
        """Never raises: every failure is a ToolResult with `error` set and a message for the model.
        `variables`: the problem's named values, passed to tools that take them (see `tool`)."""
        tool_ = self.tools.get(call.name)
        if tool_ is None:
            text, error = f"unknown tool {call.name[:64]!r}; available: {sorted(self.tools)}", "unknown_tool"
        elif (problem := check_arguments(tool_, call.arguments)) is not None:
            text, error = problem, "bad_arguments"  # may quote the model's argument names: cut like any result
        else:
            args = {**call.arguments, "variables": dict(variables or {})} if tool_.takes_variables else call.arguments
            text, error = _run_bounded(tool_.fn, args, self.timeout_s)
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + " [truncated]"
        return ToolResult(call.name, f"Error: {text}" if error else text, error)


# ------------------------------------------------------------------------------------------------ built-ins


def format_value(value: Fraction) -> str:
    """An exact value as the model sees it: an integer, or p/q with a decimal approximation."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator} (about {float(value):.6g})"


@tool("Evaluate an arithmetic expression of integers with + - * / and parentheses, exactly.",
      {"expression": {"type": "string", "description": "e.g. (3 + 5) * 7"}})
def calculator(expression: str, *, variables: dict[str, int] | None = None) -> str:
    """The problem's named values (e.g. a, b) may appear in the expression when the task defines them."""
    found = evaluate_arithmetic(expression, variables)
    if found.error is not None:
        raise ToolError(f"invalid expression: {found.error}")
    return format_value(found.value)


@tool("Check a Countdown answer: what the expression equals, and whether it uses each number exactly once "
      "and reaches the target.",
      {"expression": "string", "numbers": {"type": "array", "items": {"type": "integer"}}, "target": "integer"})
def check_countdown(expression: str, numbers: list, target: int) -> str:
    if len(numbers) > 16 or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise ToolError("numbers must be a list of at most 16 integers")
    found = evaluate_arithmetic(expression.split("=", 1)[0])
    if found.error is not None:
        raise ToolError(f"invalid expression: {found.error}")
    check = check_equation(expression, tuple(numbers), target)
    verdict = "correct" if check.correct else f"not a solution: {check.reason}"
    return f"{format_value(found.value)}; {verdict}"


BUILTIN_TOOLS: dict[str, Tool] = {t.name: t for t in (calculator, check_countdown)}
