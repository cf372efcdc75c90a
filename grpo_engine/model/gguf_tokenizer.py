"""A GGUF file's tokenizer as a `tokenizers.Tokenizer` and the engine's Tokenizer (chat template included).

GGUF stores a BPE tokenizer ("gpt2" model) as its token list, merges, token types and special ids; how text is
split before BPE is named by `tokenizer.ggml.pre`. Each supported name maps to the pre-tokenizer the model's
Hugging Face tokenizer.json uses; an unknown one is refused (a wrong split gives plausible but wrong ids).
Several names share one split, as llama.cpp's llama-vocab.cpp groups them (llama3 / llama-v3 / smaug-bpe are
llama-bpe's, deepseek-r1-qwen is qwen2's).
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .hf_io import CheckpointError
from .tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT, Tokenizer  # (the Split patterns: model/tokenizer.py)


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


PRE_TOKENIZERS = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),  # llama.cpp's spelling
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),  # read, never written
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "llama-bpe": lambda: _split_then_bytes(LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(LLAMA3_SPLIT),  # llama.cpp's alias of llama-bpe
    "llama-v3": lambda: _split_then_bytes(LLAMA3_SPLIT),  # likewise
    "smaug-bpe": lambda: _split_then_bytes(LLAMA3_SPLIT),  # Smaug-Llama-3, SmolLM3: Llama 3's tokenizer
    "qwen2": lambda: _split_then_bytes(QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(QWEN2_SPLIT),  # DeepSeek-R1 distills of Qwen2.5
}
# Names whose tokenizer.json has `"ignore_merges": true` in its BPE model (Llama 3's and its derivatives): a
# pre-token that is itself in the vocabulary is one token, merges or not. Why it matters: Llama 3's vocabulary
# comes from tiktoken and its merges were rebuilt from it, so some tokens are not reached by the merges; BPE
# alone splits them and gives ids the model never saw. (llama.cpp ignores merges for its llama3 group; for
# smaug-bpe it does not, but the tokenizer.json those files come from does.)
IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe"})
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that are special tokens
# Tokens llama.cpp ends generation at by their text (llama-vocab.cpp, "find EOG tokens"), besides the file's
# eos / eot / eom ids: a GGUF holds one eos id, and these are the other ids generation_config.json lists
# (Qwen's <|endoftext|>, Llama 3's <|end_of_text|> and <|eom_id|>).
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                       "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"})


def build_tokenizer(meta: dict, source: str) -> Tokenizer:
    """The engine's Tokenizer from GGUF metadata (tokenizer.ggml.* and tokenizer.chat_template)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{source}: tokenizer model {model!r} is not supported (only BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                              f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                 ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    special = [AddedToken(t, special=ty == CONTROL, normalized=False)
               for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens([a for a in special if a.special])
    tok.add_tokens([a for a in special if not a.special])
    config = _tokenizer_config(meta, tokens)
    eog = eog_token_ids(meta, tokens)
    generation: dict = {"eos_token_id": eog} if eog else {}
    if "tokenizer.ggml.bos_token_id" in meta:
        generation["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    return Tokenizer(tok, config, generation, origin=source, template_origin=f"{source} (tokenizer.chat_template)")


def eog_token_ids(meta: dict, tokens: list[str]) -> list[int]:
    """The ids generation stops at, as llama.cpp stops: eos first, then eot, eom and the EOG_TEXTS tokens.

    Why not eos alone: a model sampled past <|endoftext|> (or Llama 3's <|end_of_text|>) where its Hugging
    Face checkpoint, and llama.cpp on the same file, stop; eval then read garbage past the end.
    """
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [int(meta[k]) for k in keys if meta.get(k) is not None]
    ids += [i for i, t in enumerate(tokens) if t in EOG_TEXTS]
    return list(dict.fromkeys(i for i in ids if 0 <= i < len(tokens)))


def _tokenizer_config(meta: dict, tokens: list[str]) -> dict:
    """tokenizer_config.json as transformers writes it: special tokens by text, the chat template."""
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                    "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                    "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 32768))}
    for ours, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id"),
                      ("unk_token", "unknown_token_id")):
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            config[ours] = tokens[int(i)]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


# ----------------------------------------------------------------------------------------------------
# Out: the tokenizer into a GGUF writer (gguf_export.py)

NORMAL, UNUSED = 1, 5


def pre_tokenizer_name(tok: HFTokenizer) -> str:
    """The llama.cpp name of a tokenizers pre-tokenizer (the inverse of PRE_TOKENIZERS)."""
    state = json.loads(tok.to_str()).get("pre_tokenizer") or {}
    kinds = [p.get("type") for p in state.get("pretokenizers", [state])]
    if kinds == ["Digits", "ByteLevel"]:
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        pattern = state["pretokenizers"][0].get("pattern", {}).get("Regex", "")
        for name, split in (("llama-bpe", LLAMA3_SPLIT), ("qwen2", QWEN2_SPLIT)):
            if pattern == split:
                return name
    if kinds == ["ByteLevel"]:
        return "gpt-2"  # llama.cpp refuses "gpt2" (unknown pre-tokenizer type)
    raise CheckpointError(f"this tokenizer's pre-tokenizer ({kinds}) has no llama.cpp equivalent this exporter "
                          f"knows (smollm, llama-bpe, qwen2, gpt-2)")


def write_tokenizer(w, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
    """tokenizer.ggml.* and tokenizer.chat_template, as llama.cpp's converter writes a BPE tokenizer."""
    tok = tokenizer._tok
    data = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab_size or 0, max(vocab.values()) + 1)
    tokens, types = [f"[PAD{i}]" for i in range(size)], [UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, NORMAL
    for added in data.get("added_tokens", []):
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    w.add_add_space_prefix(False)
    w.add_add_bos_token(bool(tokenizer.config.get("add_bos_token", False)))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer_name(tok))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("unk_token", w.add_unk_token_id), ("pad_token", w.add_pad_token_id)):
        text = tokenizer.special_tokens.get(key)
        if text is not None and text in vocab:
            add(vocab[text])
    if tokenizer.chat_template_source:
        w.add_chat_template(tokenizer.chat_template_source)
