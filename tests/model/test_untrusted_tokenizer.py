"""Chat templates and tokenizer.json files are untrusted input (issue 41). A template may render 1 MiB in 1 s
(model/chat_template.py); a tokenizer.json regex that backtracks, a replacement that multiplies the text and a
malformed file are refused at load (model/tokenizer.py). Every failure is one line naming the file: bombs probed
in a subprocess capped at 4 GB and 20 s (bounded.py), and a seeded fuzz of the renderer and of the loader ends
every input in a result or a CheckpointError, never another exception."""

import json
import random
import shutil
import subprocess
import sys
import time
from datetime import datetime

import pytest
from bounded import MEMORY_BYTES, SECONDS_EACH, assert_refused, run_probes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from grpo_engine import CheckpointError, load_tokenizer
from grpo_engine.model import template_budget
from grpo_engine.model.chat_template import TemplateError, compile_template, render_template
from grpo_engine.model.gguf_io import find_smollm2_gguf
from grpo_engine.model.tiny import CHATML_TEMPLATE, LLAMA3_TEMPLATE
from grpo_engine.model.tokenizer import GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT, Tokenizer, load_hf_tokenizer

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
REPEAT = "{{ 'x' * 200000000 }}"
BACKTRACKS = "(a+)+$"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓ 2+2?"},
            {"role": "assistant", "content": "<think>easy</think>4"}, {"role": "user", "content": "and 3+3?"}]


def with_template(src, dst, template):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return dst


def with_tokenizer_json(src, dst, change):
    shutil.copytree(src, dst)
    data = json.loads((dst / "tokenizer.json").read_text())
    change(data)
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


def split_by(pattern):
    return lambda data: data.update(pre_tokenizer={"type": "Split", "pattern": {"Regex": pattern},
                                                   "behavior": "Isolated", "invert": False})


# ------------------------------------------------------------------------------------------- end to end


def test_issue_probes_end_in_one_line_within_bounds(tiny_ckpt_factory, tmp_path):
    """The two template failures of the issue and a backtracking tokenizer regex, through `grpo generate`."""
    src = tiny_ckpt_factory("qwen2")
    dirs = [with_template(src, tmp_path / "loops", NESTED_LOOPS), with_template(src, tmp_path / "bomb", REPEAT),
            with_tokenizer_json(src, tmp_path / "regex", split_by(BACKTRACKS))]
    results = run_probes([["generate", str(d), "2+2", "--max-new", "1", "--device", "cpu"] for d in dirs])
    assert_refused(results[0], "loops/tokenizer_config.json", "ran for more than 1 s")
    assert_refused(results[1], "bomb/tokenizer_config.json", "1 MiB")
    assert_refused(results[2], "regex/tokenizer.json", BACKTRACKS, "backtracks")


PROBE = """
import json, resource, sys, time, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
from grpo_engine.model.chat_template import compile_template, render_template
out = []
for source in json.loads(sys.stdin.read()):
    tracemalloc.start()
    start = time.perf_counter()
    try:
        render_template(compile_template(source, "T.jinja"), "T.jinja", {{"messages": []}})
        error = None
    except Exception as e:
        error = f"{{type(e).__name__}}: {{e}}"
    out.append({{"error": error, "seconds": time.perf_counter() - start, "peak": tracemalloc.get_traced_memory()[1]}})
    tracemalloc.stop()
print(json.dumps(out))
"""
BOMBS = {  # template: what the error says; each would take minutes or gigabytes unbounded
    NESTED_LOOPS: "ran for more than 1 s",
    REPEAT: "repeats a value past 1 MiB",
    "{{ ['x'] * 200000000 }}": "repeats a value past 1 MiB",
    "{{ 2 ** 100000000 }}": "more than 20000 digits",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}": "more than 1 s",
    "{% macro f() %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endmacro %}"
    "{% set s = 'x' * 1000000 %}{{ f()|length }}": "rendered more than 1 MiB",
    "{% set a = 'x' * 1000 %}" + "{% set a = a ~ a %}" * 40 + "{{ a }}": "larger than 1 MiB",
    "{% set a = 'x' %}{% set b = 'x' %}" + "{% set a = [a, a] %}{% set b = [b, b] %}" * 40 + "{{ a == b }}":
        "larger than 1 MiB",
    "{% set a = 'x' * 1000 %}{% set b = {}.fromkeys(range(1000), a) %}{{ {}.fromkeys(range(1000), b) }}":
        "larger than 1 MiB",
    "{% set s = 'x' * 100000 %}{{ s|replace('', s) }}": "replace filter",
    "{% set s = 'x' * 100000 %}{{ s.replace('', s) }}": "str.replace",
    "{% set s = 'x' * 1000 %}{{ range(100000)|join(s) }}": "larger than 1 MiB",
    "{{ 'x'|center(1000000000) }}": "passes a number beyond",
    "{{ '%1000000000s'|format('x') }}": "width beyond 1 MiB",
    "{% set s = 'x' * 1000000 %}{{ ('{0}' * 1000).format(s) }}": "formats a string past 1 MiB",
    "{% set s = '\n' * 100000 %}{{ s|indent(1000000) }}": "indent filter",
    "{% set s = 'x' * 1000000 %}{{ [1]|batch(1000000, s)|list }}": "batch filter",
    "{{ ('y' * 1000000)|groupby('x') }}": "more than 100000 items",
    "{{ {'a': {'b': 1}}|tojson(indent=100000000) }}": "passes a number beyond",
}


def test_template_bombs_are_refused_in_time_and_memory():
    """Each bomb ends in its one-line error within 3 s (the deadline is 1 s) and 64 MB of Python allocations,
    in a process that may use 4 GB."""
    code = PROBE.format(memory=MEMORY_BYTES)
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(list(BOMBS)), capture_output=True, text=True,
                         timeout=SECONDS_EACH + 3 * len(BOMBS))
    assert out.returncode == 0, out.stderr[-3000:]
    for (source, needle), result in zip(BOMBS.items(), json.loads(out.stdout)):
        assert result["error"] and result["error"].startswith("CheckpointError: T.jinja: "), (source[:80], result)
        assert needle in result["error"] and "\n" not in result["error"], (source[:80], result)
        assert result["seconds"] < 3 and result["peak"] < 64 << 20, (source[:80], result)


def test_nested_loops_stop_at_the_deadline_and_repetition_before_it_allocates():
    template = compile_template(NESTED_LOOPS, "T")
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="ran for more than 1 s"):
        render_template(template, "T", {})
    assert 0.9 < time.perf_counter() - start < 3
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="past 1 MiB"):
        render_template(compile_template(REPEAT, "T"), "T", {})
    assert time.perf_counter() - start < 0.1


# --------------------------------------------------------------------------------------- jinja errors


@pytest.mark.parametrize("source, needle", [
    ("{% for %}", "does not compile: Expected an expression"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not compile: RecursionError"),
    ("hi\n{{ foo.bar.baz }}", "failed: UndefinedError: 'foo' is undefined (template line 2)"),
    ("{{ ''.__class__.__mro__ }}", "failed: SecurityError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed: RecursionError"),
    ("{{ 1|join }}", "failed: TypeError"),
    ("{{ lipsum(100000) }}", "'lipsum' is undefined"),  # one call that ran for many seconds: gone
])
def test_template_errors_are_one_line_checkpoint_errors(tiny_ckpt_factory, tmp_path, source, needle):
    tok = load_tokenizer(with_template(tiny_ckpt_factory("qwen2"), tmp_path / "tok", source))
    with pytest.raises(CheckpointError) as e:
        tok.apply_chat_template(MESSAGES)
    assert str(e.value).startswith(f"{tmp_path / 'tok' / 'tokenizer_config.json'}: the chat template ")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_raise_exception_names_the_template_file(tiny_ckpt_factory, tmp_path):
    dst = tmp_path / "tok"
    shutil.copytree(tiny_ckpt_factory("qwen2"), dst)
    (dst / "chat_template.jinja").write_text("{{ raise_exception('no tools here') }}")
    with pytest.raises(TemplateError, match=r"chat_template\.jinja: no tools here"):
        load_tokenizer(dst).apply_chat_template(MESSAGES)


# ----------------------------------------------------------------------------------- real templates

TOOLS_TEMPLATE = """{%- set ns = namespace(system=none) %}
{%- macro render(m) %}{{ '<|' ~ m.role ~ '|>\\n' }}{{ m.content|trim }}{% endmacro %}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}
{%- set messages = messages[1:] %}{% endif %}
{{- bos_token ~ '<|system|>\\n' + (ns.system or 'You are helpful.') }}
{%- if tools %}{{ '\\n# Tools\\n' }}{% for t in tools %}{{ t|tojson(indent=4) }}{{ '\\n' if not loop.last }}{% endfor %}
{{- '\\n%s tool(s): %s' % (tools|length, tools|map(attribute='function.name')|join(', ')) }}{% endif %}
{%- for m in messages %}{{ '\\n' + render(m) }}{% if m.tool_calls %}{% for c in m.tool_calls %}
{{- '\\n{{"name": "{}", "arguments": {}}}'.format(c.function.name, c.function.arguments|tojson) }}
{%- endfor %}{% endif %}
{%- endfor %}{{ ('\\n<|assistant|>\\n' if add_generation_prompt else '') ~ eos_token * 0 }}
{{- messages|selectattr('role', 'equalto', 'user')|list|length }}{{ (messages|last).content[::-1][:3] }}"""
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "évalue ✓", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
CALL = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2+2"}}}]},
    {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4 ✓"}]


def unbounded(source: str):
    """The sandbox as transformers (and this engine before issue 41) built it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def test_real_templates_render_byte_identical_to_the_unbounded_sandbox():
    smol = find_smollm2_gguf()
    templates = [CHATML_TEMPLATE, LLAMA3_TEMPLATE, TOOLS_TEMPLATE]
    templates += [load_tokenizer(smol).chat_template_source] if smol else []
    for source in templates:
        for messages in (MESSAGES, CALL, MESSAGES[1:2]):
            for tools in (None, TOOLS):
                variables = {"messages": messages, "tools": tools, "add_generation_prompt": tools is None,
                             "bos_token": "<s>", "eos_token": "</s>"}
                expected = unbounded(source).render(**variables)
                assert render_template(compile_template(source, "T"), "T", variables) == expected, source[:60]


# --------------------------------------------------------------------------------------- tokenizer.json


def test_a_backtracking_regex_panics_in_tokenizers():
    """The measurement behind the load-time probe: Oniguruma stops a match after 10^7 steps with a panic, a
    BaseException that `except Exception` does not catch (below the limit, each line takes seconds)."""
    split = pre_tokenizers.Split(Regex(BACKTRACKS), "isolated")
    start = time.perf_counter()
    with pytest.raises(BaseException, match="retry-limit-in-match") as e:
        split.pre_tokenize_str("a" * 30 + "b")
    assert not isinstance(e.value, Exception) and time.perf_counter() - start < 5


@pytest.mark.parametrize("change, needle", [
    (split_by(BACKTRACKS), "backtracks catastrophically"),
    (lambda d: d.update(normalizer={"type": "Replace", "pattern": {"Regex": r"(x+x+)+y"}, "content": "z"}),
     "backtracks catastrophically"),
    (lambda d: d.update(normalizer={"type": "Replace", "pattern": {"String": "a"}, "content": "y" * 100000}),
     "Replace content of 100000 characters"),
    (lambda d: d.update(decoder={"type": "Replace", "pattern": {"String": ""}, "content": "z"}),
     "Replace of the empty string"),
])
def test_hostile_tokenizer_json_is_refused_at_load(tiny_ckpt_factory, tmp_path, change, needle):
    path = with_tokenizer_json(tiny_ckpt_factory("qwen2"), tmp_path / "tok", change)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(path)
    assert time.perf_counter() - start < SECONDS_EACH
    assert str(e.value).startswith(f"{path / 'tokenizer.json'}: ") and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_a_panic_while_encoding_is_a_checkpoint_error():
    raw = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(BACKTRACKS), "isolated")
    with pytest.raises(CheckpointError, match=r"^tok\.json: the tokenizer failed \(.*retry-limit"):
        Tokenizer(raw, {}, origin="tok.json").encode("a" * 30 + "b")


@pytest.mark.parametrize("pattern", [GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT])
def test_well_known_regexes_load_without_a_probe(tiny_ckpt_factory, tmp_path, monkeypatch, pattern):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probed a well-known regex"))
    path = with_tokenizer_json(tiny_ckpt_factory("qwen2"), tmp_path / "tok", split_by(pattern))
    assert load_tokenizer(path).encode("ab12") == [ord(c) for c in "ab12"]


def test_padding_and_truncation_in_the_file_are_ignored(tiny_ckpt_factory, tmp_path):
    def pad_to_a_billion(data):
        data["padding"] = {"strategy": {"Fixed": 10**9}, "direction": "Right", "pad_to_multiple_of": None,
                           "pad_id": 0, "pad_type_id": 0, "pad_token": "a"}
        data["truncation"] = {"direction": "Right", "max_length": 1, "strategy": "LongestFirst", "stride": 0}

    path = with_tokenizer_json(tiny_ckpt_factory("qwen2"), tmp_path / "tok", pad_to_a_billion)
    assert load_tokenizer(path).encode("abc") == [97, 98, 99]


@pytest.mark.parametrize("file, text, needle", [
    ("tokenizer.json", '{"version": "1.0", "model": {"type": "BPE", "vocab": {', "could not be parsed"),
    ("tokenizer_config.json", "[1, 2]", "holds a JSON list, not an object"),
    ("tokenizer_config.json", '{"eos_token": 5}', "eos_token is 5, not a token's text"),
    ("tokenizer_config.json", '{"chat_template": [1]}', "chat_template is a list of other than"),
    ("generation_config.json", '"x"', "holds a JSON str, not an object"),
    ("chat_template.json", "[]", "holds a JSON list, not an object"),
])
def test_malformed_tokenizer_files_are_one_line_errors(tiny_ckpt_factory, tmp_path, file, text, needle):
    dst = tmp_path / "tok"
    shutil.copytree(tiny_ckpt_factory("qwen2"), dst)
    (dst / file).write_text(text)
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(dst)
    assert str(e.value).startswith(str(dst / file)) and needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- fuzz

NUMBERS = ["0", "1", "-1", "1000", "100000", "10**9", "2**64", "1.5", "none", "'3'"]
VALUES = ["'x'", "''", "'ab' * 1000", "messages[0]['content']", "'\\t\\n'", "('y' * 500000)", "s", "none", "[1, 2]",
          "{'a': 'b'}", "ns", "messages"]
HOSTILE = [
    "{{% for i in range({n}) %}}{{% for j in range({n}) %}}{{{{ {v} }}}}{{% endfor %}}{{% endfor %}}",
    "{{{{ {v} * {n} }}}}", "{{{{ [{v}] * {n} }}}}", "{{{{ {n} ** {n} }}}}", "{{{{ {n} * {n} * {n} }}}}",
    "{{{{ {v}|replace({v}, {v}) }}}}", "{{{{ {v}.replace('', {v}) }}}}", "{{{{ {v}|center({n}) }}}}",
    "{{{{ {v}|indent({v}) }}}}", "{{{{ {v}|wordwrap({n}, wrapstring={v}) }}}}", "{{{{ {v}|batch({n}, {v})|list }}}}",
    "{{{{ {v}|slice({n}, {v})|list }}}}", "{{{{ {v}|format({v}) }}}}", "{{{{ ('%' ~ {n} ~ 's') % {v} }}}}",
    "{{{{ ('{{0}}' * {n}).format({v}) }}}}",
    "{{% macro f(n) %}}{{{{ f(n) }}}}{{{{ f(n) }}}}{{% endmacro %}}{{{{ f({n}) }}}}",
    "{{% set a = [{v}, {v}] %}}" + "{{% set a = [a, a] %}}" * 30 + "{{{{ a == a|list }}}}",
    "{{{{ {{}}.fromkeys(range({n}), {v}) }}}}", "{{{{ {v}.__class__ }}}}", "{{{{ {n} / 0 }}}}",
    "{{{{ {v}|tojson(indent={n}) }}}}", "{{{{ raise_exception({v}) }}}}", "{{{{ {v}.expandtabs({n}) }}}}",
    "{{% set ns.x = {v} %}}{{% for i in range({n}) %}}{{% set ns.x = ns.x ~ ns.x %}}{{% endfor %}}{{{{ ns.x }}}}",
    "{{{{ {v}.translate({{97: {v}}}) }}}}", "{{{{ {v}|sum(start={v}) }}}}", "{{{{ range({n})|join({v}) }}}}",
    "{{{{ {v}|list|sort|unique|list|length }}}}", "{{{{ {v}|groupby('x') }}}}", "{{{{ {v}|pprint }}}}",
    "{{{{ {v} ~ {v} ~ {v} }}}}", "{{{{ {v} + {v} + {v} }}}}", "{{{{ namespace(a={v}) }}}}", "{{{{ {v}.split({v}) }}}}",
    "{{% for x in {v} recursive %}}{{{{ loop({v}) }}}}{{% endfor %}}", "{{{{ ({v}, {v}) * {n} }}}}",
    "{{% set b %}}{{% for i in range({n}) %}}{{{{ {v} }}}}{{% endfor %}}{{% endset %}}{{{{ b|length }}}}",
]
TOKENS = ["{%", "%}", "{{", "}}", "{#", "endfor", "endif", "(", ")", "[", "|", "'", "\x00", "é", "~", "**", "set", "."]


def fuzzed_template(rng: random.Random, k: int) -> str:
    if k % 2:
        return "{% set s = 'x' * 100 %}{% set ns = namespace(x='y') %}" + rng.choice(HOSTILE).format(
            n=rng.choice(NUMBERS), v=rng.choice(VALUES))
    src = rng.choice([CHATML_TEMPLATE, LLAMA3_TEMPLATE, TOOLS_TEMPLATE])
    for _ in range(rng.randint(1, 4)):  # cut a span, insert a token, or repeat a span
        i, j = sorted(rng.randrange(len(src) + 1) for _ in range(2))
        r = rng.random()
        src = src[:i] + (src[j:] if r < 0.4 else rng.choice(TOKENS) + src[i:] if r < 0.8 else src[i:j] * 3 + src[j:])
    return src


def test_fuzz_chat_template_renderer(monkeypatch):
    """300 malformed and hostile templates, each rendered or refused in one line; the deadline cut to 50 ms so
    that the time-bound ones do not take the suite's time."""
    monkeypatch.setattr(template_budget, "MAX_SECONDS", 0.05)
    rng, start, outcomes = random.Random(41), time.perf_counter(), {"ok": 0, "refused": 0}
    for k in range(300):
        source = fuzzed_template(rng, k)
        try:
            render_template(compile_template(source, "T"), "T", {"messages": MESSAGES, "tools": TOOLS,
                                                                 "add_generation_prompt": True})
            outcomes["ok"] += 1
        except CheckpointError as e:
            assert str(e).startswith("T: ") and "\n" not in str(e), (source, e)
            outcomes["refused"] += 1
    assert time.perf_counter() - start < 30 and min(outcomes.values()) > 30, outcomes


def base_tokenizer_json() -> str:
    vocab = {chr(c): i for i, c in enumerate(range(33, 127))}
    vocab.update({"Ġ": 94, "he": 95, "ll": 96, "hell": 97, "[UNK]": 98})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l"), ("he", "ll")], unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s{2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GPT2_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_end|>"])
    return tok.to_str()


REGEXES = ["(a+)+$", r"(\w+\s?)+$", "(", "", r"\p{L}+", "a{1000}", r"(x+x+)+y", ".*.*=.*", r"\s+|\S+"]
JUNK = [None, -1, 0, 2**64, 1e308, "", "x" * 5000, [], {}, True, [[[]]], {"Regex": "(a+)+$"}, {"String": ""},
        "ByteLevel", "Split", "Replace", "WordLevel"]


def fuzzed_tokenizer_json(rng: random.Random, base: str) -> str:
    r = rng.random()
    if r < 0.15:
        return base[: rng.randrange(len(base))]
    if r < 0.25:
        raw = bytearray(base.encode())
        for _ in range(rng.randint(1, 5)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return raw.decode("utf-8", "replace")
    data = json.loads(base)
    if r < 0.35:  # a valid file with another regex or replacement
        data["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": rng.choice(REGEXES)}
        data["normalizer"]["normalizers"][1]["content"] = "y" * rng.choice([1, 16, 17, 100000])
        return json.dumps(data)
    for _ in range(rng.randint(1, 3)):  # a value anywhere (the vocabulary seldom) made wrong
        paths, todo = [], [((), data)]
        while todo:
            path, x = todo.pop()
            paths += [path] if path and (path[:2] != ("model", "vocab") or rng.random() < 0.05) else []
            items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else []
            todo += [((*path, k), v) for k, v in items]
        *parent_path, key = rng.choice(paths)
        parent = data
        for k in parent_path:
            parent = parent[k]
        parent[key] = rng.choice(JUNK)
    return json.dumps(data)


def test_fuzz_tokenizer_loader(tiny_ckpt_factory, tmp_path):
    """240 truncated, garbled and mistyped tokenizer.json files, each loaded and used or refused in one line."""
    dst = tmp_path / "tok"
    shutil.copytree(tiny_ckpt_factory("qwen2"), dst)
    rng, base, start, outcomes = random.Random(41), base_tokenizer_json(), time.perf_counter(), {"ok": 0, "refused": 0}
    for _ in range(240):
        (dst / "tokenizer.json").write_text(fuzzed_tokenizer_json(rng, base))
        try:
            tok = load_hf_tokenizer(dst)
            tok.decode(tok.encode("hello  wörld aaaaaaaaaaaaaaaaaaaaaaaaaaaaab 123 <|im_end|>"))
            tok.encode_batch(["a b", "c"])
            outcomes["ok"] += 1
        except CheckpointError as e:
            assert str(e).startswith(str(dst / "tokenizer.json")) and "\n" not in str(e), e
            outcomes["refused"] += 1
    assert time.perf_counter() - start < 30 and min(outcomes.values()) > 10, outcomes
