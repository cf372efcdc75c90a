"""Tokenizer: tokenizer.json through `tokenizers`, chat templates (model/chat_template.py: rendered the way
transformers renders them, in a sandbox bounded in time and size), and the set of ids that end a completion.

A tokenizer.json is untrusted input too. Its regexes run in Oniguruma, which backtracks: a pattern like
`(a+)+$` panics (pyo3's PanicException, a BaseException) once a match passes 10^7 steps, and below that
limit can take seconds per line of ordinary text. At load, each regex that is not a well-known
pre-tokenizer's is probe-encoded in a child process with a deadline (`_probe_regexes`); every error of the
Rust tokenizer, at load or later, is a one-line CheckpointError that names the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cached_property
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from ..config.paths import read_regular, regular_path
from .chat_template import compile_template, one_line, render_template
from .config import FAMILIES
from .hf_io import MAX_JSON_BYTES, CheckpointError, read_json

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialised AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class _RustErrors:
    """The Rust tokenizer's own errors (a bare Exception; pyo3's PanicException, a BaseException, e.g. when a
    regex passes Oniguruma's backtracking limit) as one-line CheckpointErrors that name the file."""

    def __init__(self, origin: str):
        self.origin = origin

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is Exception or (kind is not None and kind.__name__ == "PanicException"):
            raise CheckpointError(f"{self.origin}: the tokenizer failed ({one_line(error)}); it is broken or "
                                  f"hostile: replace it") from None
        return False


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` with the chat template and special tokens of its directory."""

    def __init__(self, tokenizer: HFTokenizer, config: dict, generation_config: dict | None = None, *,
                 origin: str = "tokenizer.json", template_origin: str = "tokenizer_config.json",
                 turn_end: tuple[str, ...] = ()):
        """origin, template_origin: the files the tokenizer and the chat template came from (for errors).
        turn_end: the model family's end-of-turn tokens (model/config.py Family.turn_end), stops where present."""
        self._tok, self._errors, self.template_origin = tokenizer, _RustErrors(origin), template_origin
        self.turn_end = turn_end
        self.config = config
        self.generation_config = generation_config or {}
        self.special_tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        self.chat_template_source: str | None = config.get("chat_template")

    # -- encoding -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Chat-templated text already holds its BOS, hence no special tokens are added by default."""
        with self._errors:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """`text` with any special-token text in it (`<|im_end|>`, ...) encoded as ordinary characters: for
        text the environment supplies (tool results), which must not open or close turns of the template."""
        self._tok.encode_special_tokens = True
        try:
            with self._errors:
                return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        with self._errors:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        with self._errors:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # -- special ids ------------------------------------------------------------------------------------

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """Ids that end a completion: generation_config.json's eos_token_id(s), then tokenizer_config's eos, then
        the family's end-of-turn tokens (Phi-3's <|end|>: a checkpoint whose generation config omits it still
        stops at the end of the assistant's turn)."""
        ids: list[int] = []
        gen = self.generation_config.get("eos_token_id")
        for i in gen if isinstance(gen, list) else [gen]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
        eos = self.special_tokens.get("eos_token")
        eos_id = self.token_to_id(eos) if eos else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        for token in self.turn_end:
            turn_id = self.token_to_id(token)
            if turn_id is not None and turn_id not in ids:
                ids.append(turn_id)
        return ids

    @property
    def pad_token_id(self) -> int:
        """Pad id for batching; any id works since padded positions are masked, so fall back to EOS."""
        pad = self.special_tokens.get("pad_token")
        pad_id = self.token_to_id(pad) if pad else None
        if pad_id is not None:
            return pad_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def save(self, out_dir: str | Path) -> Path:
        """tokenizer.json, tokenizer_config.json (chat template included) and, when known, generation_config.json
        (written only if the directory has none): files transformers, vLLM and load_tokenizer read."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        config = dict(self.config)
        if self.chat_template_source and "chat_template" not in config:
            config["chat_template"] = self.chat_template_source
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        if self.generation_config and not (out / "generation_config.json").exists():
            (out / "generation_config.json").write_text(json.dumps(self.generation_config, indent=2))
        return out

    # -- chat template ------------------------------------------------------------------------------------

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template_source:
            raise CheckpointError("this tokenizer has no chat_template (tokenizer_config.json / chat_template.jinja)")
        return compile_template(self.chat_template_source, self.template_origin)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render messages to the prompt string exactly as transformers' apply_chat_template(tokenize=False),
        within chat_template.py's bounds (1 MiB, 1 s; a one-line CheckpointError past them)."""
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(kwargs)
        return render_template(self._template, self.template_origin,
                               dict(messages=messages, add_generation_prompt=add_generation_prompt, **variables))


def load_hf_tokenizer(path: Path) -> Tokenizer:
    """Load tokenizer.json, tokenizer_config.json (+ chat_template.jinja) and generation_config.json."""
    tok_file = path / "tokenizer.json"
    if not tok_file.exists():
        raise CheckpointError(
            f"{tok_file} not found: the directory needs a fast-tokenizer file (save it with "
            f"AutoTokenizer.save_pretrained or copy it from the base model)"
        )
    regular_path(tok_file, "tokenizer file", error=CheckpointError, fix="re-download or re-save it")  # not a FIFO
    try:
        tokenizer = HFTokenizer.from_file(str(tok_file))
    except BaseException as e:  # a bare Exception on a malformed file; a PanicException (a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"{tok_file} could not be parsed ({one_line(e)}); re-download or re-save it") from None
    tokenizer.no_padding()  # the engine pads; a file's padding (to 10^9 ids, say) would act on every encode
    tokenizer.no_truncation()
    _probe_regexes(tokenizer, tok_file)
    with _RustErrors(str(tok_file)):  # what else panics (a malformed vocabulary, say) does so here, not mid-run
        tokenizer.decode(tokenizer.encode("Hello, world! 123 é中\n\t").ids)
    config_file = path / "tokenizer_config.json"
    config = _read_object(config_file) if config_file.exists() else {}
    for key in SPECIAL_TOKEN_KEYS:
        if not isinstance(_token_text(config.get(key)), (str, type(None))):
            raise CheckpointError(f"{config_file}: {key} is {one_line(repr(config[key]), 60)}, not a token's text; "
                                  f"fix the file")
    config["chat_template"], origin = _read_template(path, config)
    gen_file = path / "generation_config.json"
    gen = _read_object(gen_file) if gen_file.exists() else None
    return Tokenizer(tokenizer, config, gen, origin=str(tok_file), template_origin=origin, turn_end=_turn_end(path))


def _turn_end(path: Path) -> tuple[str, ...]:
    """The end-of-turn tokens of the family config.json names (none for a directory without one)."""
    config_file = path / "config.json"
    model_type = _read_object(config_file).get("model_type") if config_file.is_file() else None
    return FAMILIES[model_type].turn_end if model_type in FAMILIES else ()


def _read_object(file: Path) -> dict:
    data = read_json(file)
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds a JSON {type(data).__name__}, not an object; re-save the tokenizer")
    return data


def _read_template(path: Path, config: dict) -> tuple[str | None, str]:
    """The chat template (chat_template.jinja, chat_template.json, else tokenizer_config.json's) and its file."""
    origin, template = path / "tokenizer_config.json", config.get("chat_template")
    if (path / "chat_template.jinja").exists():
        origin = path / "chat_template.jinja"
        try:
            template = read_regular(origin, "chat template", max_bytes=MAX_JSON_BYTES, option="a smaller template",
                                    error=CheckpointError).decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{origin} is not UTF-8 text ({e.reason}); fix or delete it") from None
    elif (path / "chat_template.json").exists():
        origin = path / "chat_template.json"
        template = _read_object(origin).get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        if not all(isinstance(t, dict) for t in template):
            raise CheckpointError(f"{origin}: chat_template is a list of other than {{name, template}} objects")
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template, str(origin)


# Split patterns of well-known tokenizers, trusted without a probe (the regexes are facts of each model family's
# tokenizer; gguf_tokenizer.py builds Llama 3's and Qwen 2's from them)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PROBE_SECONDS = 10.0  # the child that probe-encodes a tokenizer's other regexes is killed after this
PROBE_CPU_SECONDS = 0.02  # CPU time one 41-character probe may take (a sane regex: microseconds)
MAX_REPLACEMENT = 16  # characters a normalizer / decoder may put in per match (real ones: "▁", " ")
_PROBE = r"""
import json, sys, time
from tokenizers import Regex, pre_tokenizers
for pattern in json.load(sys.stdin):
    split = pre_tokenizers.Split(Regex(pattern), "isolated")
    chars = sorted({c for c in pattern if c.isalnum()} | set("a0 \n.'é中_-!"))[:32]
    probes = [c * 40 + end for c in chars for end in ("", "!", "b", " ", "\n", "1", "\x00")]
    for text in probes + [(c + " ") * 20 + "!" for c in chars]:
        start = time.process_time()
        try:
            split.pre_tokenize_str(text)
            why = "" if time.process_time() - start < LIMIT else f"took {time.process_time() - start:.2f} s"
        except BaseException as e:
            why = " ".join(str(e).split())[:120]
        if why:
            print(f"the regex {pattern[:80]!r} backtracks catastrophically (on {text[:10]!r}...: {why})")
            sys.exit(3)
"""


def _regexes(tok: HFTokenizer, tok_file: Path) -> list[str]:
    """Every regex of the tokenizer's normalizer, pre-tokenizer and decoder (Split / Replace patterns). A
    replacement longer than MAX_REPLACEMENT is refused (100k characters per match made an encode allocate
    gigabytes, and Rust aborts the process when an allocation fails), and so is a Replace of "" (it panics)."""
    found: list[str] = []

    def walk(x):
        if isinstance(x, dict):
            found.extend([x["Regex"]] if isinstance(x.get("Regex"), str) else [])
            if x.get("type") == "Replace" and x.get("pattern") in ({"String": ""}, {"Regex": ""}):
                raise CheckpointError(f"{tok_file}: a Replace of the empty string (tokenizers panics on it); this "
                                      f"tokenizer.json is broken or hostile")
            for key in ("content", "prepend", "replacement"):
                if isinstance(x.get(key), str) and len(x[key]) > MAX_REPLACEMENT:
                    raise CheckpointError(f"{tok_file}: a {x.get('type')} {key} of {len(x[key])} characters (at "
                                          f"most {MAX_REPLACEMENT}); this tokenizer.json is broken or hostile")
            x = list(x.values())
        for v in x if isinstance(x, list) else []:
            walk(v)

    for part in (tok.normalizer, tok.pre_tokenizer, tok.decoder):
        if part is not None:
            walk(json.loads(part.__getstate__()))
    return found


def _probe_regexes(tok: HFTokenizer, tok_file: Path) -> None:
    """Each regex that is not a well-known pre-tokenizer's, run over adversarial strings (a run of one
    character, then one that fails the match) in a child process with a deadline; a regex that panics or
    takes more than PROBE_CPU_SECONDS on 41 characters is refused in one line."""
    patterns = sorted(set(_regexes(tok, tok_file)) - {GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT})
    if not patterns:
        return
    fix = "this tokenizer.json is broken or hostile: replace it"
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE.replace("LIMIT", str(PROBE_CPU_SECONDS))],
                             input=json.dumps(patterns), capture_output=True, text=True, timeout=PROBE_SECONDS,
                             env={**os.environ, "RUST_BACKTRACE": "0"})
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"{tok_file}: a regex did not finish 41-character probes in {PROBE_SECONDS:g} s "
                              f"(catastrophic backtracking); {fix}") from None
    if out.returncode != 0:
        raise CheckpointError(f"{tok_file}: {one_line(out.stdout or out.stderr[-300:])}; {fix}")
