"""Answer extraction, format checks and a safe arithmetic evaluator for untrusted model output.

Model output is untrusted input: nothing here evaluates it as code, and every function is fast *by
construction* rather than by a timer (timers based on signals only work in the main thread):
- extraction looks only at the last MAX_SCAN_CHARS characters (answers sit at the end of a completion);
- tags and braces are found with str.find / rfind and explicit loops, never with a lazy `.*?` regex that
  could go quadratic on many unclosed tags;
- the few regexes used have no nested quantifiers, so they run in linear time;
- the arithmetic evaluator (expressions.py) rejects long input and deep nesting *before* parsing, caps literal
  sizes and the magnitude of every intermediate value, and has no exponentiation.

Digits: only ASCII 0-9 count as digits. Unicode digits such as Arabic-Indic '٣' are treated as ordinary
characters (an answer written with them is wrong, never a crash). We decided this because Python's int()
and Fraction() silently accept them, which would make 'the same' answer depend on the script it is in.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

MAX_SCAN_CHARS = 16_384  # extraction looks at most at this many trailing characters of a completion
MAX_ANSWER_CHARS = 1_024  # an extracted answer longer than this is rejected (None)
MAX_NUMBER_DIGITS = 64  # a numeric literal with more digits is not a number we compare (huge literals)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

# ASCII-only number: optional sign (an ASCII hyphen or the Unicode minus U+2212, which models and LaTeX
# renderings emit: read as a digit-less character, "−5" would be the number 5), digits with optional thousands
# separators, decimals (".5" too: read from its digits alone it would be 5), a /denominator.
# No nested quantifiers: each part is deterministic given the next character, so matching is linear.
_NUMBER_RE = re.compile(r"[-\u2212]?(?:[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?|\.[0-9]+)(?:/[0-9]+)?")
_ANSWER_IS_RE = re.compile(r"the\s{1,5}(?:final\s{1,5})?answer\s{1,5}is\s{0,5}:?", re.IGNORECASE)
# \frac{a}{b}, and the brace-less single-digit forms \frac12, \dfrac1{2}, \frac{1}2 that LaTeX accepts (read
# as a plain number, \frac12 would be twelve)
_FRAC_ARG = r"(?:\{([-\u2212]?[0-9]{1,64})\}|([0-9]))"  # {digits} or one bare digit
_FRAC_RE = re.compile(r"([-\u2212]?)\\[dt]?frac" + _FRAC_ARG + _FRAC_ARG)
# "Answer: X" / "Final answer: X" at the start of a line (markdown bold and a leading '#' tolerated)
_ANSWER_LINE_RE = re.compile(r"^[ \t#*]{0,8}(?:final\s{1,5})?answer\s{0,3}\**\s{0,3}:\**", re.IGNORECASE | re.MULTILINE)
_TRAILER = " \t\r\n.!*$)]}\"'`"  # what may follow a final number: punctuation, markdown, closing brackets


def _tail(text: str, n: int = MAX_SCAN_CHARS) -> str:
    return text[-n:] if len(text) > n else text


def _accept(answer: str) -> str | None:
    answer = answer.strip()
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


def _last(pattern: re.Pattern, text: str) -> re.Match | None:
    """The last match of `pattern` in `text` (the model's final word), or None."""
    last = None
    for last in pattern.finditer(text):  # noqa: B007 - only the last one is kept
        pass
    return last


def _answer_text(line: str) -> str | None:
    """The answer a line states after its marker: bold, LaTeX \\( \\) and $ delimiters and a final period dropped."""
    line = line.strip().strip("*").strip().removeprefix("\\(").removesuffix("\\)").strip("$ ")
    return _accept(line.rstrip(".").strip("$ *"))


# ----------------------------------------------------------------------------------------------- extraction
def extract_answer_tag(text: str) -> str | None:
    """Content of the LAST complete <answer>...</answer> block (the model's final word), or None."""
    t = _tail(text)
    end = t.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = t.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return _accept(t[start + len(ANSWER_OPEN) : end])


def extract_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} (nested braces balanced), or of the `\boxed 5` short form."""
    t = _tail(text)
    i = t.rfind("\\boxed")
    if i < 0:
        return None
    j = i + len("\\boxed")
    if j < len(t) and t[j] == " ":  # \boxed 5 : the argument is the next whitespace-free run
        rest = t[j + 1 : j + 1 + MAX_ANSWER_CHARS].split(None, 1)
        return _accept(rest[0].rstrip("$.")) if rest else None
    if j >= len(t) or t[j] != "{":
        return None
    depth, stop = 0, min(len(t), j + 2 + MAX_ANSWER_CHARS)
    for k in range(j, stop):
        if t[k] == "{":
            depth += 1
        elif t[k] == "}":
            depth -= 1
            if depth == 0:
                return _accept(t[j + 1 : k])
    return None  # unbalanced or too long


def extract_answer_is(text: str) -> str | None:
    """Text after the last 'the (final) answer is', up to the end of its line or sentence ('. ')."""
    t = _tail(text)
    last = _last(_ANSWER_IS_RE, t)
    if last is None:
        return None
    return _answer_text(t[last.end() : last.end() + 256].split("\n", 1)[0].split(". ", 1)[0])  # line or sentence


def extract_last_number(text: str) -> str | None:
    """The last ASCII number in the text (thousands separators, decimals and a/b fractions allowed); None when
    it is only the tail of a longer token ('2^{10}', '1e3', '12-7': see parse_number)."""
    t = _tail(text).replace("{,}", ",")  # LaTeX's 1{,}000
    last = _last(_NUMBER_RE, t)
    return last.group(0) if last is not None and not _glued(t, last.start()) else None


def extract_answer_line(text: str) -> str | None:
    """The rest of the last line that starts with 'Answer:' (or 'Final answer:'), trailing period dropped."""
    t = _tail(text)
    last = _last(_ANSWER_LINE_RE, t)
    return None if last is None else _answer_text(t[last.end() : last.end() + MAX_ANSWER_CHARS].split("\n", 1)[0])


def extract_final_number(text: str) -> str | None:
    """A number that ENDS the completion (only punctuation, markdown or closing brackets after it): '2 + 3 = 5.'
    gives 5. Unlike last_number, a completion cut off mid-sentence by the length limit rarely ends on one, so
    a number that merely appears in it does not count as an answer."""
    tail = _tail(text).rstrip(_TRAILER)[-(MAX_NUMBER_DIGITS + 16) :]
    last = _last(_NUMBER_RE, tail)
    if last is None or last.end() != len(tail) or _glued(tail, last.start()):
        return None  # no number at the very end, or only the tail of one ('2^{10}', '1e3': not 10 or 3)
    return last.group(0)


# markdown, closing quotes and brackets that may follow the mark ending a sentence ('... is "tac".**')
_AFTER_SENTENCE = "*_`\"')]}\u201d"


def extract_sentence_number(text: str) -> str | None:
    """The last number of the sentence that closes the reply, when the reply closes one ('.' or '!', markdown or
    a quote after it): '2 kilograms is 2000 grams.' gives 2000, 'The letter "n" appears 1 time in "lemon".'
    gives 1, the forms in which small instruct models state a count or a conversion. A reply cut off by the
    length limit rarely ends a sentence, so a number inside an unfinished one does not count."""
    t = _tail(text).rstrip().rstrip(_AFTER_SENTENCE).rstrip()
    if not t.endswith((".", "!")):
        return None
    body = t[:-1]
    start = max(body.rfind(". "), body.rfind("! "), body.rfind("? "), body.rfind("\n"))  # -1: the whole reply
    sentence = body[start + 1 :]
    last = _last(_NUMBER_RE, sentence)
    return None if last is None or _glued(sentence, last.start()) else last.group(0)


# ------------------------------------------------------------------------------ option letters and words
# An option letter is an UPPERCASE A-J standing alone with a mark that makes it a choice: the article "A", the
# pronoun "I" and the letters inside "BAD" or "Apple" carry none. Each pattern is linear (no nested quantifiers).
_LETTER = r"([A-J])(?![A-Za-z0-9])"
# "answer is B", "Answer: (B)", "correct option is **B**": the keyword, then "is" or ":" ("Option A is 12" is not)
_CHOICE_STATED_RE = re.compile(
    r"(?<![A-Za-z])(?i:answer|option|choice)(?:\s{1,5}(?i:is)\s{0,5}:?|\s{0,5}:)\s{0,5}[(\[*]{0,2}" + _LETTER)
_CHOICE_MARKED_RE = re.compile(
    r"(?<![A-Za-z0-9])[(\[]" + _LETTER + r"[)\]]"  # (B)  [B]
    r"|(?<![A-Za-z0-9(\[])" + _LETTER + r"\)"  # B)
    r"|\*\*[(\[]?" + _LETTER + r"[)\].:]?\*\*"  # **B**  **(B)**  **B.**
    r"|^[ \t>#*-]{0,8}" + _LETTER + r"[.:]?[ \t*]*$"  # a line that is only the letter: "B", "B."
    r"|^[ \t>#*-]{0,8}" + _LETTER + r"[.:][ \t]",  # a line that starts "B. 78" / "B: 78"
    re.MULTILINE,
)
_WORD_TRIM = " \t\r\n.,;:!?*_`\"'()[]{}<>"  # markdown, quotes, brackets and punctuation around a word
_WORD_RE = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")  # one word: letters / digits, inner ' or -
# a quoted or bold word closing the line; its closing punctuation may sit inside the quotes ('is "tac."')
_QUOTED_WORD_RE = re.compile(
    r"(?:\"|'|`|\*\*|\u201c)([^\W_]+(?:['\u2019-][^\W_]+)*)[.!?]?(?:\"|'|`|\*\*|\u201d)$")
# a word in double quotes or bold anywhere in the line (single quotes are left out: "it's ... don't" is no quote)
_QUOTED_ANY_RE = re.compile(r"(?:\"|\*\*|\u201c)([^\W_]+(?:['\u2019-][^\W_]+)*)[.!?,]?(?:\"|\*\*|\u201d)")


def _letter(m: re.Match) -> str:
    return next(g for g in m.groups() if g)


def extract_choice(text: str) -> str | None:
    """The option letter a reply picks: the last one stated ('The answer is B', 'Answer: (B)', 'correct option
    is B'), else the last marked one ('(B)', 'B)', '**B**', a line 'B.' or 'B. 78'). None when no letter stands
    as a choice: 'A' inside a word, the article 'A' and 'I' never count, so a reply cut off mid-sentence
    rarely scores by chance. None too for a reply that lists several options, each starting its line, and
    states none (a line 'A) 83', then a line 'D) 32'): taking its last line as the pick would reward listing the
    options."""
    t = _tail(text)
    stated = _last(_CHOICE_STATED_RE, t)
    if stated is not None:
        return _letter(stated)
    marked = list(_CHOICE_MARKED_RE.finditer(t))
    if not marked:
        return None
    listed = {_letter(m) for m in marked if _starts_line(t, m.start())}
    return None if _starts_line(t, marked[-1].start()) and len(listed) > 1 else _letter(marked[-1])


def _starts_line(text: str, at: int) -> bool:
    """Whether only blanks or a list / quote / bold mark precede position `at` on its line."""
    return not text[text.rfind("\n", 0, at) + 1 : at].strip(" \t>#*-")


def extract_final_word(text: str) -> str | None:
    """The word that ends the reply: its last non-empty line when that is one word ('Paris', '**tac**.'), a
    quoted or bold word closing that line ('... backwards is "tac".', '... is "tac."'), or the one word that line
    quotes when it ends a sentence ('The word "tac" is the answer.'). A reply cut off mid-sentence ends on a line of
    many words and gives None, as final_number does for a number inside one; so does a line that quotes two
    different words."""
    lines = [ln for ln in _tail(text).splitlines() if ln.strip()]
    if not lines:
        return None
    last = lines[-1].strip()
    line = last.rstrip(".!?,;: \t")
    bare = line.strip(_WORD_TRIM)
    if _WORD_RE.fullmatch(bare):
        return _accept(bare)
    closing = _QUOTED_WORD_RE.search(line[-(MAX_ANSWER_CHARS + 6) :])
    if closing is not None:
        return _accept(closing.group(1))
    if not last.rstrip(_AFTER_SENTENCE).endswith((".", "!")):  # cut off, or a question
        return None
    quoted = {m.group(1).casefold(): m.group(1) for m in _QUOTED_ANY_RE.finditer(line)}
    return _accept(next(iter(quoted.values()))) if len(quoted) == 1 else None


# an answer that opens with its letter and goes on to say why: 'C, which is the odd one out' (what answer_is
# takes from 'The answer is C, which is the odd one out.'); not 'A, B or C', which lists options
_LEADING_LETTER_RE = re.compile(r"[(\[*]{0,2}" + _LETTER + r"[)\]*]{0,2}[,;](?!\s{0,3}[(\[*]{0,2}[A-J](?![A-Za-z0-9]))")


def choice_letter(answer: str | None) -> str | None:
    """The option letter an answer string names: the whole string when it is one letter ('B', 'b', '(B)',
    '**B.**'), the letter that opens it before a comma ('C, which is odd'), else the letter extract_choice finds
    in it ('(B) 78' from 'The answer is (B) 78.')."""
    if answer is None:
        return None
    bare = answer.strip(_WORD_TRIM)
    if len(bare) == 1 and bare.upper() in "ABCDEFGHIJ":
        return bare.upper()
    leading = _LEADING_LETTER_RE.match(answer.lstrip())
    return leading.group(1) if leading else extract_choice(answer)


def choice_equal(a: str | None, b: str | None) -> bool:
    """Whether two answers name the same option letter (False when either names none)."""
    x, y = choice_letter(a), choice_letter(b)
    return x is not None and x == y


def word_key(answer: str) -> str:
    """An answer compared as words: case folded, punctuation and markdown dropped, whitespace collapsed
    ('**Paris.**' and 'paris' are the same; 'New York' and 'newyork' are not)."""
    kept = "".join(ch if ch.isalnum() or ch.isspace() else " " if ch in "-/" else "" for ch in answer.casefold())
    return " ".join(kept.split())


def word_equal(a: str | None, b: str | None) -> bool:
    """Whether two answers are the same word(s) up to case and punctuation (False when either is empty)."""
    if a is None or b is None:
        return False
    x = word_key(a[:MAX_ANSWER_CHARS])
    return bool(x) and x == word_key(b[:MAX_ANSWER_CHARS])


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "answer_tag": extract_answer_tag,
    "boxed": extract_boxed,
    "answer_is": extract_answer_is,
    "answer_line": extract_answer_line,
    "final_number": extract_final_number,
    "last_number": extract_last_number,
    "sentence_number": extract_sentence_number,
    "choice": extract_choice,
    "final_word": extract_final_word,
}
# The default for chat models: the requested forms first, then the common ways small instruct models state a
# result, ending with a number that closes the reply. (R1-style runs pin ("answer_tag", ...) in their config.)
DEFAULT_CASCADE = ("answer_tag", "boxed", "answer_line", "answer_is", "final_number")


@dataclass(frozen=True)
class Extraction:
    answer: str | None  # the extracted final-answer text, None when no step found one
    method: str | None  # name of the EXTRACTORS step that found it


def extract_answer(text: str, cascade: tuple[str, ...] = DEFAULT_CASCADE) -> Extraction:
    """Run the extraction steps in order and return the first hit."""
    for name in cascade:
        found = EXTRACTORS[name](text)
        if found is not None:
            return Extraction(found, name)
    return Extraction(None, None)


def check_cascade(cascade: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Validate a configured extraction cascade; returns it as a tuple."""
    unknown = [c for c in cascade if c not in EXTRACTORS]
    if unknown or not cascade:
        valid = list(EXTRACTORS)
        raise ValueError(f"unknown answer extractor(s) {unknown} in {list(cascade)}; valid: {valid}")
    return tuple(cascade)


# --------------------------------------------------------------------------------------------- format checks
def strict_format(text: str) -> float:
    """1.0 when the text is `[preamble]<think>...</think> <answer>...</answer>` with each tag exactly once,
    only whitespace between </think> and <answer> and after </answer>, and a non-empty answer; else 0.0.

    The preamble allows an assistant prefill such as 'Let me solve this step by step.\\n' before <think>.
    """
    tags = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
    if any(text.count(tag) != 1 for tag in tags):
        return 0.0
    a, b, c, d = (text.find(tag) for tag in tags)
    if not a < b < c < d:
        return 0.0
    between = text[b + len(THINK_CLOSE) : c]
    after = text[d + len(ANSWER_CLOSE) :]
    answer = text[c + len(ANSWER_OPEN) : d]
    return 1.0 if not between.strip() and not after.strip() and answer.strip() else 0.0


def partial_format(text: str) -> float:
    """0.25 for each of the four tags that appears exactly once: a dense signal early in training."""
    tags = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
    return sum(0.25 for tag in tags if text.count(tag) == 1)


def answer_tag_format(text: str) -> float:
    """1.0 when the text has exactly one non-empty <answer>...</answer> block (no <think> required)."""
    if text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1:
        return 0.0
    c, d = text.find(ANSWER_OPEN), text.find(ANSWER_CLOSE)
    return 1.0 if c < d and text[c + len(ANSWER_OPEN) : d].strip() else 0.0


def bare_number_format(text: str) -> float:
    """1.0 when the whole text (ignoring surrounding whitespace) is one number, e.g. "47" or "-3.5".

    The answer format of the CPU demo: a tiny model learns a 2-3 token answer far faster than a tagged one.
    """
    t = text.strip()
    return 1.0 if len(t) <= MAX_NUMBER_DIGITS and _NUMBER_RE.fullmatch(t) else 0.0


def answer_line_format(text: str) -> float:
    """1.0 when the last non-empty line is 'Answer: <something>' (the form the instruct prompts ask for)."""
    lines = [ln for ln in _tail(text).splitlines() if ln.strip()]
    return 1.0 if lines and _ANSWER_LINE_RE.match(lines[-1]) and extract_answer_line(lines[-1]) else 0.0


def boxed_format(text: str) -> float:
    r"""1.0 when the text has a complete \boxed{...} answer."""
    return 1.0 if extract_boxed(text) is not None else 0.0


FORMAT_REWARDS: dict[str, Callable[[str], float]] = {
    "strict": strict_format,
    "partial": partial_format,
    "answer_tag": answer_tag_format,
    "answer_line": answer_line_format,
    "boxed": boxed_format,
    "bare_number": bare_number_format,
}


# ------------------------------------------------------------------------------------------------- numbers
def parse_number(text: str) -> Fraction | None:
    r"""The number an answer string denotes, tolerant of '$', commas, units, '%', trailing '.0', 'a/b' and
    \frac{a}{b}; the last number wins ('x = 5 apples' -> 5). None when there is none or it is too big, and
    when the last number is glued to what precedes it: an exponent ('2^{10}', '1e3'), a malformed number
    ('10,00', '1.2.3') or a difference ('12-7'). Read alone, such a tail is a different number (10, 3, 0, -7)
    and scored a wrong answer as right whenever it happened to equal the reference."""
    s = text[:MAX_ANSWER_CHARS].replace("\\!", "").replace("\\,", ",").replace("{,}", ",")
    frac, number = _last(_FRAC_RE, s), _last(_NUMBER_RE, s)  # the last of each wins
    if frac is not None and (number is None or number.start() < frac.end()):
        if _glued(s, frac.start()):
            return None
        sign = -1 if frac.group(1) else 1
        num, den = (_to_fraction(frac.group(i) or frac.group(i + 1)) for i in (2, 4))
        return sign * num / den if num is not None and den else None
    if number is None or _glued(s, number.start()):
        return None
    return _to_fraction(number.group())


# wrappers that only style their argument: \text{5} is just 5 (a longer name first where one ends another)
_PLAIN_COMMANDS = ("text", "textbf", "textit", "textrm", "texttt", "mathbf", "mathrm", "mathit", "mathsf", "mathtt",
                   "boldsymbol", "bm", "emph", "underline", "boxed", "fbox", "mbox")


def _glued(s: str, start: int) -> bool:
    r"""Whether the number at s[start] continues the token before it instead of standing alone: it follows an
    ASCII digit ('12-7') or letter ('x2', '\frac12', '\sqrt2'), a ',' or 'e' right after a digit ('10,00',
    '1e3'), '^' or '_', or the '{' of an exponent, a second argument or a command ('2^{10}', '\frac{1}{2}' cut
    short, '\sqrt{2}') other than a plain wrapper such as \text{} or \boxed{}."""
    prev, prev2 = s[start - 1 : start], s[max(0, start - 2) : max(0, start - 1)]
    if prev == "{":
        if prev2.isascii() and prev2.isalpha():
            head = s[max(0, start - 12) : start - 1]
            return not any(head.endswith("\\" + name) for name in _PLAIN_COMMANDS)
        return prev2 in ("^", "_", "}")
    if prev.isascii() and prev.isalnum() or prev in ("^", "_"):
        return True
    return prev in (",", "e", "E") and "0" <= prev2 <= "9"


def _to_fraction(token: str) -> Fraction | None:
    token = token.replace(",", "").replace("\u2212", "-")
    if sum(ch.isdigit() for ch in token) > MAX_NUMBER_DIGITS:
        return None
    if "/" in token:
        num, den = token.split("/", 1)
        return Fraction(Fraction(num), int(den)) if int(den) else None
    return Fraction(token)


def numbers_close(a: Fraction, b: Fraction, tol: float = 1e-6) -> bool:
    """|a - b| <= tol * max(1, |b|): absolute near zero, relative for large values, which absorbs a rounded
    decimal ('0.333333' for 1/3). Next to an integer the gap must also be under 1/2: the relative bound alone
    reaches 1 at a million, and 2,000,001 or 2000000.5 are not 2,000,000."""
    gap = abs(a - b)
    if (a.denominator == 1 or b.denominator == 1) and gap >= Fraction(1, 2):
        return False
    return gap <= Fraction(tol) * max(1, abs(b))


def numeric_equal(a: str | None, b: str | None, tol: float = 1e-6) -> bool:
    """Whether two answer strings denote the same number (False when either is not a number)."""
    if a is None or b is None:
        return False
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and numbers_close(x, y, tol)
