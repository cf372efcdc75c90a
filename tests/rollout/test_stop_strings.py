"""Stop strings match the text the tokens spell, even where the tokenizer's decoder cleans up spaces (a
WordPiece `cleanup`, a SentencePiece decoder that drops the first token's leading space)."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from grpo_engine.model.tokenizer import Tokenizer
from grpo_engine.rollout import SamplingParams, generate
from grpo_engine.rollout.stop_strings import StopStrings

LLAMA2_DECODER = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
)


def word_tokenizer(vocab: dict[str, int], decoder) -> Tokenizer:
    tok = HFTokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    tok.decoder = decoder
    return Tokenizer(tok, {})


def test_metaspace_first_token_keeps_its_space_in_generate(tiny_model):
    """Every id of the tiny model is a word-start piece "▁t{i}." (decoded " t{i}."). With prepend_scheme="first"
    the decoder drops the space of the first token decoded, so " t{f}." for the completion's first token f
    was never seen: the completion ran on (to max_new_tokens, or to a later f)."""
    tok = word_tokenizer({f"▁t{i}.": i for i in range(272)}, decoders.Metaspace("▁", prepend_scheme="first"))
    prompt = [5, 6, 7]
    free = generate(tiny_model, [prompt], SamplingParams(temperature=0.0, max_new_tokens=8)).completion_ids[0]
    first = free[0]
    assert tok.decode([first]) == f"t{first}."  # the decoder's own text lacks the space
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_strings=[f" t{first}."])
    out = generate(tiny_model, [prompt], params, tokenizer=tok)
    assert out.completion_ids == [[first]] and out.finish_reason == ["stop"]


def test_strip_decoder_leading_space_at_the_start_of_a_tail():
    tok = word_tokenizer({"▁Answer": 0, ":": 1, "▁42": 2}, LLAMA2_DECODER)
    assert tok.decode([0, 1]) == "Answer:"  # Strip(left=1) drops the leading space
    assert StopStrings([" Answer"], tok)([0])
    assert StopStrings(["Answer: "], tok)([0, 1, 2])  # a trailing space arrives with the next word-start piece
    assert not StopStrings([" 42"], tok)([0, 1])


def test_wordpiece_cleanup_does_not_hide_a_space_before_punctuation():
    """WordPiece's cleanup turns "end ." into "end." and "it 's" into "it's"."""
    tok = word_tokenizer({"end": 0, ".": 1, "it": 2, "'": 3, "s": 4, "##s": 5}, decoders.WordPiece("##", cleanup=True))
    assert tok.decode([0, 1]) == "end."
    assert StopStrings([" ."], tok)([0, 1])
    assert StopStrings(["end "], tok)([0, 1])
    assert StopStrings(["it ' s"], tok)([2, 3, 4])
    assert StopStrings(["ends"], tok)([0, 5]) and not StopStrings([" s"], tok)([0, 5])  # "##s" joins its word


def test_byte_level_tokenizer_is_used_as_is(tiny_tok):
    """A decoder with nothing to clean up (byte-level BPE) is not copied."""
    from grpo_engine.rollout.stop_strings import _literal_backend

    assert _literal_backend(tiny_tok._tok) is tiny_tok._tok
    ids = tiny_tok.encode("x = 1 .\n")
    assert StopStrings([" .\n"], tiny_tok)(ids) and not StopStrings(["1.\n"], tiny_tok)(ids)
