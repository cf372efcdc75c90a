"""Tokenizer: tokenizer.json through `tokenizers`, chat templates rendered with jinja2 the way
transformers renders them, and the set of ids that end a completion.

Chat-template rendering follows transformers' conventions: a sandboxed jinja2 environment with
`trim_blocks` and `lstrip_blocks`, the `raise_exception` and `strftime_now` globals, a `tojson` filter
that keeps non-ASCII characters, and the special tokens (bos_token, eos_token, ...) as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .hf_io import CheckpointError, read_json

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TemplateError(ValueError):
    """Raised by a chat template's raise_exception(...)."""


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialised AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` with the chat template and special tokens of its directory."""

    def __init__(self, tokenizer: HFTokenizer, config: dict, generation_config: dict | None = None):
        self._tok = tokenizer
        self.config = config
        self.generation_config = generation_config or {}
        self.special_tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        self.chat_template_source: str | None = config.get("chat_template")

    # -- encoding -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Chat-templated text already holds its BOS, hence no special tokens are added by default."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """`text` with any special-token text in it (`<|im_end|>`, ...) encoded as ordinary characters: for
        text the environment supplies (tool results), which must not open or close turns of the template."""
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # -- special ids ------------------------------------------------------------------------------------

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """Ids that end a completion: generation_config.json's eos_token_id(s), then tokenizer_config's eos."""
        ids: list[int] = []
        gen = self.generation_config.get("eos_token_id")
        for i in gen if isinstance(gen, list) else [gen]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
        eos = self.special_tokens.get("eos_token")
        eos_id = self.token_to_id(eos) if eos else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
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
        return _compile_template(self.chat_template_source)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render messages to the prompt string exactly as transformers' apply_chat_template(tokenize=False)."""
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(kwargs)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def load_hf_tokenizer(path: Path) -> Tokenizer:
    """Load tokenizer.json, tokenizer_config.json (+ chat_template.jinja) and generation_config.json."""
    tok_file = path / "tokenizer.json"
    if not tok_file.exists():
        raise CheckpointError(
            f"{tok_file} not found: the directory needs a fast-tokenizer file (save it with "
            f"AutoTokenizer.save_pretrained or copy it from the base model)"
        )
    try:
        tokenizer = HFTokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"{tok_file} could not be parsed ({e})") from e
    config = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").exists() else {}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        config["chat_template"] = jinja_file.read_text()
    elif (path / "chat_template.json").exists():
        config["chat_template"] = read_json(path / "chat_template.json").get("chat_template")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        config["chat_template"] = next((t["template"] for t in template if t.get("name") == "default"), None)
    gen_file = path / "generation_config.json"
    gen = read_json(gen_file) if gen_file.exists() else None
    return Tokenizer(tokenizer, config, gen)
