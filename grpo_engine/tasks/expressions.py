"""A safe evaluator of integer arithmetic for untrusted text (Countdown answers, the calculator tool).

Never `eval`: a tokenizer and a recursive-descent parser over integers, + - * / and parentheses, exact with
Fractions. Every input is bounded *before* work is done -- expression length, literal size, parenthesis depth
(which bounds the recursion) -- and every intermediate value's magnitude during it, so evaluation is fast by
construction. Names are allowed only when the caller gives their values (a problem's named operands).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

MAX_EXPR_CHARS = 256  # longer expressions are rejected before tokenising
MAX_PAREN_DEPTH = 32  # deeper nesting is rejected before parsing (bounds the recursion)
MAX_LITERAL_DIGITS = 9  # integer literals longer than this are rejected
MAX_MAGNITUDE = 10**18  # any intermediate numerator or denominator beyond this aborts the evaluation
_OPERATOR_ALIASES = {"×": "*", "÷": "/", "−": "-", "–": "-"}
# LaTeX spellings (an answer in \boxed{} or \(...\) writes '(6 - 2) \times 4 + 8'); \left and \right only size
# the bracket that follows them
_LATEX_COMMANDS = {"times": "*", "cdot": "*", "div": "/", "left": "", "right": ""}


class ExpressionError(ValueError):
    """Raised inside the evaluator; evaluate_arithmetic turns it into Evaluation.error."""


@dataclass(frozen=True)
class Evaluation:
    value: Fraction | None  # exact value, None when the expression is invalid
    numbers: tuple[int, ...]  # integer literals in the order they appear
    error: str | None  # why the expression was rejected, None when valid


def evaluate_arithmetic(expr: str, variables: Mapping[str, int] | None = None) -> Evaluation:
    """Evaluate integers with + - * / and parentheses exactly (Fractions). Never raises, never evals.

    No unary minus, no decimals, no exponentiation; × ÷ − and LaTeX's \\times \\cdot \\div are accepted as
    * / -. `variables` names integers the expression may use (`a*b` with {"a": 287, "b": 232}); any other name
    is an error. Without `variables` (None) letters are not allowed at all.
    """
    try:
        tokens = _tokenize(expr, variables)
        parser = _Parser(tokens)
        value = parser.expression(0)
        if parser.pos != len(tokens):
            raise ExpressionError(f"unexpected {tokens[parser.pos]!r} at token {parser.pos}")
        return Evaluation(value, tuple(parser.numbers), None)
    except ExpressionError as e:
        return Evaluation(None, (), str(e))


def _tokenize(expr: str, variables: Mapping[str, int] | None) -> list[str | int]:
    if len(expr) > MAX_EXPR_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPR_CHARS} characters")
    for name, op in _LATEX_COMMANDS.items():  # bounded: at most MAX_EXPR_CHARS characters, and it only shrinks
        expr = expr.replace("\\" + name, op)
    tokens: list[str | int] = []
    depth, i, n = 0, 0, len(expr)
    while i < n:
        ch = _OPERATOR_ALIASES.get(expr[i], expr[i])
        if ch in " \t\n":
            i += 1
        elif "0" <= ch <= "9":
            j = i
            while j < n and "0" <= expr[j] <= "9":
                j += 1
            if j - i > MAX_LITERAL_DIGITS:
                raise ExpressionError(f"number literal longer than {MAX_LITERAL_DIGITS} digits")
            tokens.append(int(expr[i:j]))
            i = j
        elif variables is not None and ch.isascii() and (ch.isalpha() or ch == "_"):
            j = i
            while j < n and expr[j].isascii() and (expr[j].isalnum() or expr[j] == "_"):
                j += 1
            tokens.append(_variable(expr[i:j], variables))
            i = j
        elif ch in "+-*/()":
            if ch == "*" and tokens and tokens[-1] == "*":
                raise ExpressionError("exponentiation is not allowed")
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth > MAX_PAREN_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_PAREN_DEPTH}")
            if depth < 0:
                raise ExpressionError("unbalanced ')'")
            tokens.append(ch)
            i += 1
        else:
            raise ExpressionError(f"character {ch!r} is not allowed")
    if depth != 0:
        raise ExpressionError("unbalanced '('")
    if not tokens:
        raise ExpressionError("empty expression")
    return tokens


def _variable(name: str, variables: Mapping[str, int]) -> int:
    if name not in variables:
        known = f"known names: {', '.join(sorted(variables))}" if variables else "no names are defined"
        raise ExpressionError(f"unknown name {name[:32]!r} ({known})")
    value = variables[name]
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_MAGNITUDE:
        raise ExpressionError(f"name {name!r} is not an integer within the evaluator's bounds")
    return value


class _Parser:
    """Recursive descent: expression := term (('+'|'-') term)*, term := factor (('*'|'/') factor)*,
    factor := integer | '(' expression ')'. Recursion depth is bounded by MAX_PAREN_DEPTH (checked above)."""

    def __init__(self, tokens: list[str | int]):
        self.tokens, self.pos, self.numbers = tokens, 0, []

    def _peek(self) -> str | int | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expression(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.term(depth)
            value = _bounded(value + rhs if op == "+" else value - rhs)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.factor(depth)
            if op == "/" and rhs == 0:
                raise ExpressionError("division by zero")
            value = _bounded(value * rhs if op == "*" else value / rhs)
        return value

    def factor(self, depth: int) -> Fraction:
        tok = self._peek()
        self.pos += 1
        if isinstance(tok, int):
            self.numbers.append(tok)
            return Fraction(tok)
        if tok == "(" and depth < MAX_PAREN_DEPTH:
            value = self.expression(depth + 1)
            if self._peek() != ")":
                raise ExpressionError("missing ')'")
            self.pos += 1
            return value
        raise ExpressionError(f"expected a number or '(' but found {tok!r}")


def _bounded(x: Fraction) -> Fraction:
    if abs(x.numerator) > MAX_MAGNITUDE or x.denominator > MAX_MAGNITUDE:
        raise ExpressionError("intermediate value too large")
    return x
