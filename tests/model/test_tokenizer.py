"""Tokenizer: round trips, EOS ids, and chat templates rendered exactly as transformers renders them."""

import json
import shutil

import pytest

from grpo_engine import CheckpointError, load_tokenizer
from grpo_engine.model.chat_template import TemplateError

transformers = pytest.importorskip("transformers")

# Templates written for these tests in the style of the Qwen (ChatML with a default system prompt) and
# Llama-3 (header ids, bos_token, trimmed content, optional date) families.
QWEN_STYLE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- set rest = messages[1:] %}
{%- else %}
{{- '<|im_start|>system\\nYou are a careful assistant.<|im_end|>\\n' }}
{%- set rest = messages %}
{%- endif %}
{%- for m in rest %}
{%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}
{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "01 Jan 2025" %}{%- endif %}
{%- for message in messages %}
    {%- set content = message['content'] | trim %}
    {%- if loop.index0 == 0 and message['role'] == 'system' %}
        {%- set content = 'Today Date: ' + date_string + '\\n\\n' + content %}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [
        {"role": "system", "content": "  Answer in <answer></answer> tags. "},
        {"role": "user", "content": "héllo ✓ wörld\n2+2"},
        {"role": "assistant", "content": "<think>easy</think><answer>4</answer>"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


def with_template(src, dst, template):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("arch, template", [("qwen2", QWEN_STYLE), ("llama3", LLAMA3_STYLE)])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(tiny_ckpt_factory, tmp_path, arch, template, conv, gen_prompt):
    path = with_template(tiny_ckpt_factory(arch), tmp_path / "tok", template)
    ours, theirs = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    messages = CONVERSATIONS[conv]
    a = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt)
    b = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    assert a == b
    assert ours.encode(a) == theirs.encode(b, add_special_tokens=False)


def test_raise_exception_in_template(tiny_ckpt_factory, tmp_path):
    tok = load_tokenizer(with_template(tiny_ckpt_factory("qwen2"), tmp_path / "tok", QWEN_STYLE))
    with pytest.raises(TemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("text", ["", "plain ascii 123", "héllo ✓ 世界 🙂\n\ttabs", "<|im_start|>user\nhi<|im_end|>"])
def test_encode_decode_round_trip(tiny_ckpt_factory, text):
    tok = load_tokenizer(tiny_ckpt_factory("qwen2"))
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tiny_ckpt_factory):
    tok = load_tokenizer(tiny_ckpt_factory("qwen2"))
    assert tok.encode("<|im_end|>") == [258]
    assert tok.encode("ab") == [ord("a"), ord("b")]
    assert tok.decode([258, 256], skip_special_tokens=True) == ""


def test_eos_ids_from_generation_and_tokenizer_config(tiny_ckpt_factory, tmp_path):
    path = tiny_ckpt_factory("llama3")
    tok = load_tokenizer(path)
    eot, end_of_text = tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")
    assert tok.eos_token_ids == [eot, end_of_text]
    no_gen = tmp_path / "nogen"
    shutil.copytree(path, no_gen)
    (no_gen / "generation_config.json").unlink()
    assert load_tokenizer(no_gen).eos_token_ids == [eot]


def test_chat_template_jinja_file_wins(tiny_ckpt_factory, tmp_path):
    dst = tmp_path / "tok"
    shutil.copytree(tiny_ckpt_factory("qwen2"), dst)
    (dst / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_tokenizer(dst).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_missing_tokenizer_file(tiny_ckpt_factory, tmp_path):
    dst = tmp_path / "tok"
    shutil.copytree(tiny_ckpt_factory("qwen2"), dst)
    (dst / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json not found"):
        load_tokenizer(dst)
