"""The text of a multi-turn trajectory: the first prompt (with tool declarations), then each later turn alone.

Why "alone": a trajectory's tokens must be exactly the tokens the policy saw and sampled. Re-rendering the
whole conversation and re-tokenizing it can change earlier tokens (BPE merges across a boundary, templates
that rewrite earlier turns, e.g. Qwen3 dropping old <think> blocks), which would make the trainer score
tokens that were never sampled. So only the new messages are rendered and tokenized, and their ids are
appended to the ids so far (rollout/multiturn.py prefills just those into the KV cache).

How the new messages are rendered with the model's own chat template: a two-message context whose assistant
turn is a sentinel string, followed by the new messages and the generation prompt; the continuation is the
text after the sentinel. It starts with the template's end of the assistant turn (e.g. `<|im_end|>\\n`),
which the policy did not emit when it was stopped at `</tool_call>`; when the policy did emit it as its stop
token, that first id is dropped (`continuation_ids`). The boundary is a special token, so tokenizing the
continuation on its own gives the tokens the template's text would give.

The appended messages come from the environment (a tool result may echo model text), so their contents are
tokenized with special-token text as plain characters: a result quoting `<|im_end|><|im_start|>user` stays
text inside its turn instead of becoming control tokens that end it (`continuation_ids`).

Tools: a template that mentions `tools` (Qwen2.5, Qwen3, Llama 3.1+) gets the declarations through
`tools=` and its own tool-message format. A template without tool support (the tiny byte-level models,
SmolLM2) gets the project's fallback format: `tools_paragraph` appended to the system message (or as one),
and each tool result as a user turn of `<tool_response>\\n...\\n</tool_response>` blocks (consecutive results
share one turn) -- the same text Qwen2.5's template produces for tool results.
"""

from __future__ import annotations

import json
import re
from typing import Any

SENTINEL = "<<grpo-turn-boundary-7c1e>>"


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template reads a `tools` variable (then it renders declarations and tool messages)."""
    return re.search(r"\btools\b", tokenizer.chat_template_source or "") is not None


def tools_paragraph(declarations: list[dict[str, Any]]) -> str:
    """The fallback declaration text: one JSON object per tool, and how to call one."""
    lines = [json.dumps(d.get("function", d), ensure_ascii=False) for d in declarations]
    return ("# Tools\n\nYou may call tools. The available tools, one JSON object per line:\n" + "\n".join(lines)
            + '\n\nTo call a tool, write <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>'
            " and stop. The result comes back as <tool_response>...</tool_response>.")


def fallback_messages(messages: list[dict[str, Any]], declarations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools listed in the system message, tool results as
    user turns of <tool_response> blocks."""
    out: list[dict[str, Any]] = []
    previous_was_tool = False
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous_was_tool:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": m["role"], "content": m["content"]})
        previous_was_tool = m["role"] == "tool"
    if declarations:
        paragraph = tools_paragraph(declarations)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{paragraph}"}
        else:
            out.insert(0, {"role": "system", "content": paragraph})
    return out


def render_first_prompt(tokenizer, messages: list[dict[str, Any]], prefill: str = "",
                        tools: list[dict[str, Any]] | None = None) -> str:
    """The first prompt's text: chat template with the generation prompt (and the tools), then the prefill.
    Without tools this is exactly tasks.render_prompt's text."""
    if tools and template_supports_tools(tokenizer):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    else:
        text = tokenizer.apply_chat_template(fallback_messages(messages, tools or []), add_generation_prompt=True)
    return text + prefill


def continuation_text(tokenizer, appended: list[dict[str, Any]]) -> str:
    """The text that follows an assistant turn when `appended` messages are added: end of the assistant
    turn, the new messages, the next generation prompt."""
    context = [{"role": "user", "content": "."}, {"role": "assistant", "content": SENTINEL}, *appended]
    if not template_supports_tools(tokenizer):
        context = fallback_messages(context, [])
    text = tokenizer.apply_chat_template(context, add_generation_prompt=True)
    # the appended messages may quote the sentinel (a tool echoing model text): those copies come after ours
    quoted = sum(str(m.get("content", "")).count(SENTINEL) for m in appended)
    if text.count(SENTINEL) != 1 + quoted:
        raise ValueError("the chat template does not render an assistant message's content verbatim; cannot "
                         "render a continuation turn on its own")
    return text[text.index(SENTINEL) + len(SENTINEL) :]


def continuation_ids(tokenizer, appended: list[dict[str, Any]], ended_with: int | None = None) -> list[int]:
    """Token ids of the continuation. ended_with: the stop token the policy ended its turn with (e.g.
    <|im_end|>), dropped from the front of the continuation since it is already in the trajectory."""
    ids = _encode_continuation(tokenizer, appended)
    return ids[1:] if ended_with is not None and ids[:1] == [ended_with] else ids


_SLOT = re.compile("(\ue000grpo-content-[0-9]+\ue001)")  # private-use characters: in no template or result


def _encode_continuation(tokenizer, appended: list[dict[str, Any]]) -> list[int]:
    """The continuation's ids with each message content encoded by `tokenizer.encode_plain` (special-token
    text as characters) and the template around them by `encode` (its control tokens as tokens).

    Contents without special-token text are encoded with the rest as one text (the usual tokens at their
    boundaries). Otherwise the template is rendered with a placeholder per content and split there; when it
    does not copy contents verbatim (it trims or escapes them) the rebuilt text differs, and the
    continuation is encoded as one text."""
    text = continuation_text(tokenizer, appended)
    texts = [i for i, m in enumerate(appended) if isinstance(m.get("content"), str) and m["content"]]
    contents = {f"\ue000grpo-content-{i}\ue001": appended[i]["content"] for i in texts}  # placeholder -> content
    plain = getattr(tokenizer, "encode_plain", None)
    if plain is None or all(plain(c) == tokenizer.encode(c) for c in contents.values()):
        return tokenizer.encode(text)
    framed = [{**m, "content": f"\ue000grpo-content-{i}\ue001"} if i in texts else m for i, m in enumerate(appended)]
    parts = _SLOT.split(continuation_text(tokenizer, framed))
    if "".join(contents.get(p, p) for p in parts) != text:
        return tokenizer.encode(text)
    ids: list[int] = []
    for p in parts:
        if p:
            ids += tokenizer.encode_plain(contents[p]) if p in contents else tokenizer.encode(p)
    return ids


def conversation_ids_and_mask(tokenizer, turns: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
    """Token ids of a whole scripted conversation after the first prompt, exactly as a rollout would build
    them: each assistant turn's text tokenized alone (it ends without a stop token, as a turn stopped at
    `</tool_call>` does), each run of other messages as its continuation. A teacher's multi-turn target for
    supervised training is then token-for-token what the policy sees when it behaves the same way.

    And per token whether the assistant wrote it (True) or the environment (False): the rollout's loss mask, so
    supervised training on a teacher's conversation learns only its turns."""
    ids: list[int] = []
    mask: list[bool] = []
    pending: list[dict[str, Any]] = []

    def add(new: list[int], own: bool) -> None:
        ids.extend(new)
        mask.extend([own] * len(new))

    for m in turns:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            add(continuation_ids(tokenizer, pending), False)
            pending = []
        add(tokenizer.encode(m["content"]), True)
    if pending:
        add(continuation_ids(tokenizer, pending), False)
    return ids, mask
