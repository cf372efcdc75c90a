"""A GGUF file's tokenizer rebuilt from its metadata: which `tokenizer.ggml.pre` names split text how, and
Llama 3's ignore_merges. Synthetic vocabularies, ids computed by hand."""

import json

import pytest

from grpo_engine.model.config import CheckpointError
from grpo_engine.model.gguf_tokenizer import build_tokenizer

LLAMA3_FAMILY = ["llama-bpe", "llama3", "llama-v3", "smaug-bpe"]
QWEN2_FAMILY = ["qwen2", "deepseek-r1-qwen"]


def gguf_meta(tokens: list[str], merges: list[str], pre: str) -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges}


# ids:     0    1    2    3    4    5     6      7
DIGITS = ["1", "2", "3", "4", "5", "12", "123", "45"]
DIGIT_MERGES = ["1 2", "12 3", "4 5"]


@pytest.mark.parametrize("pre", LLAMA3_FAMILY)
def test_llama3_names_split_digits_in_threes(pre):
    """llama3 / llama-v3 / smaug-bpe were refused; they split like llama-bpe: digit runs of up to three,
    "12345" -> "123" "45" -> merged to ids 6 and 7."""
    assert build_tokenizer(gguf_meta(DIGITS, DIGIT_MERGES, pre), "m.gguf").encode("12345") == [6, 7]


@pytest.mark.parametrize("pre", QWEN2_FAMILY)
def test_qwen2_names_split_every_digit(pre):
    """deepseek-r1-qwen was refused; it splits like qwen2: each digit alone, so no merge applies."""
    assert build_tokenizer(gguf_meta(DIGITS, DIGIT_MERGES, pre), "m.gguf").encode("12345") == [0, 1, 2, 3, 4]


def test_unknown_pre_tokenizer_is_refused_by_name():
    with pytest.raises(CheckpointError, match=r"m.gguf: tokenizer.ggml.pre='made-up' is not supported; "
                                              r"supported: .*deepseek-r1-qwen.*llama3.*smaug-bpe"):
        build_tokenizer(gguf_meta(DIGITS, DIGIT_MERGES, "made-up"), "m.gguf")


# ids:     0    1    2    3     4
LETTERS = ["a", "b", "c", "ab", "abc"]  # "abc" is in the vocabulary, but no merge builds it


@pytest.mark.parametrize("pre", LLAMA3_FAMILY)
def test_llama3_family_ignores_merges_for_whole_vocabulary_words(pre):
    """Llama 3's tokenizer.json sets ignore_merges: the pre-token "abc", itself a token, is id 4. Built with
    merges applied, it came out as "ab" "c" = [3, 2], ids the model was never trained on."""
    tok = build_tokenizer(gguf_meta(LETTERS, ["a b"], pre), "m.gguf")
    assert tok.encode("abc") == [4]
    assert tok.encode("abcab") == [3, 2, 3]  # not itself a token: plain BPE ("a b" merges twice)
    assert json.loads(tok._tok.to_str())["model"]["ignore_merges"] is True  # kept in a saved tokenizer.json


@pytest.mark.parametrize("pre", QWEN2_FAMILY)
def test_other_names_apply_merges(pre):
    assert build_tokenizer(gguf_meta(LETTERS, ["a b"], pre), "m.gguf").encode("abc") == [3, 2]
