"""Stop strings: end a completion at the token that completes one of them.

A stop string is matched in the text the tokens spell, not in the tidied text a decoder makes of it. Some
decoders clean up spaces: WordPiece's `cleanup` turns "end ." into "end.", and SentencePiece decoders
(Metaspace with prepend_scheme "first"/"always", a `Strip` step) drop the leading space of the first token
decoded. Matching on that output would miss " ." after a word and a " Answer" that opens a completion or a tool
turn. So the tail is decoded by a copy of the tokenizer whose decoder keeps every space (`literal_decoder`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache

from tokenizers import Tokenizer as HFTokenizer


def _keep_spaces(decoder: dict | None) -> dict | None:
    """A decoder spec (tokenizer.json's "decoder") with every space clean-up switched off."""
    if not isinstance(decoder, dict):
        return decoder
    out = dict(decoder)
    kind = out.get("type")
    if kind == "Sequence":
        out["decoders"] = [_keep_spaces(d) for d in out.get("decoders", [])]
    elif kind == "Metaspace":  # "first"/"always" strip the first token's leading space when decoding
        out["prepend_scheme"], out["add_prefix_space"] = "never", False
    elif kind == "Strip":
        out["start"] = out["stop"] = 0
    if "cleanup" in out:  # WordPiece, CTC: " ." -> ".", " 's" -> "'s", ...
        out["cleanup"] = False
    return out


@lru_cache(maxsize=8)
def _literal_backend(backend: HFTokenizer) -> HFTokenizer:
    spec = json.loads(backend.to_str())
    literal = _keep_spaces(spec.get("decoder"))
    if literal == spec.get("decoder"):
        return backend  # byte-level decoders (Qwen, Llama 3) change nothing: no copy
    return HFTokenizer.from_str(json.dumps({**spec, "decoder": literal}))


def literal_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> the text they spell, special tokens included, with no space cleaned up. Takes our Tokenizer,
    a transformers fast tokenizer (`backend_tokenizer`; its decode also applies clean_up_tokenization_spaces)
    or a `tokenizers.Tokenizer`; anything else is decoded by its own decode()."""
    candidates = (getattr(tokenizer, "backend_tokenizer", None), getattr(tokenizer, "_tok", None), tokenizer)
    backend = next((b for b in candidates if isinstance(b, HFTokenizer)), None)
    if backend is None:
        return lambda ids: tokenizer.decode(ids)
    literal = _literal_backend(backend)
    return lambda ids: literal.decode(list(ids), skip_special_tokens=False)


class StopStrings:
    """Detects a stop string newly completed by a row's last token, decoding only a short tail.

    Earlier steps already checked (and found nothing in) every earlier tail, so a match in the tail of the
    last `window` tokens must end in the new token. The window is long enough for the longest stop string
    even if every token decodes to a single byte, plus a margin for partial characters at its start.
    """

    def __init__(self, stop_strings: list[str], tokenizer):
        self.strings = stop_strings
        self.decode = literal_decoder(tokenizer) if stop_strings else None
        self.window = max((len(s.encode()) for s in stop_strings), default=0) + 4

    def __call__(self, tokens: list[int]) -> bool:
        if not self.strings:
            return False
        tail = self.decode(tokens[-self.window :])
        return any(s in tail for s in self.strings)
