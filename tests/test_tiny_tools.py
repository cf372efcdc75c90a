"""configs/tiny_tools.yaml (a tiny model with a calculator), its teacher's tokens, the tools config section, and
`grpo demo --tools`, which runs the real model."""

import json
from pathlib import Path

import pytest

from grpo_engine.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TINY_TOOLS = REPO / "configs" / "tiny_tools.yaml"


def test_tiny_tools_config():
    cfg = load_config(TINY_TOOLS)
    assert cfg.warm_start.tiny.arch and cfg.tools.enabled and cfg.tools.names == ["calculator"]
    assert cfg.task.options["operations"] == ["*"] and cfg.task.options["digits"] == 3


def test_tools_section_checks_its_values():
    assert not load_config(None).tools.enabled
    with pytest.raises(ConfigError, match="unknown tool 'calculater'.*did you mean 'calculator'"):
        load_config(None, ["tools.names=[calculater]"])
    with pytest.raises(ConfigError, match="tools.format='xml' is not one of auto, fallback, undeclared"):
        load_config(None, ["tools.format=xml"])
    with pytest.raises(ConfigError, match="tools.max_turns=0 must be >= 1"):
        load_config(None, ["tools.max_turns=0"])
    with pytest.raises(ConfigError, match="at least one name"):
        load_config(None, ["tools.enabled=true", "tools.names=[]"])


def test_teacher_conversation_is_the_rollout_tokens(tiny_ckpt):
    """The SFT target of a tool-using teacher is byte for byte what a rollout appends: the call, the tool turn
    rendered on its own (end of turn, user turn with the <tool_response> block, generation prompt), the answer."""
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.sft.warm_start import sft_pairs
    from grpo_engine.train.setup import task_of

    tok = load_tokenizer(tiny_ckpt)
    task = task_of(load_config(TINY_TOOLS, ["task.options.n_train=40"]))
    examples = task.examples("train")
    pairs = sft_pairs(task, tok, examples)
    with_tool = [(ex, pair) for ex, pair in zip(examples, pairs) if task.reference_conversation(ex) is not None]
    assert 0 < len(with_tool) < len(examples)
    ex, (_, ids, own) = with_tool[0]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "a*b"}}</tool_call>'  # named operands
    assert tok.decode(ids) == (f"{call}<|im_end|>\n<|im_start|>user\n<tool_response>\n{ex.a * ex.b}\n"
                               f"</tool_response><|im_end|>\n<|im_start|>assistant\n{ex.a * ex.b}<|im_end|>")
    # only the teacher's own tokens are targets: the tool turn between the call and the answer is context
    targets = "".join(tok.decode([t]) if keep else "_" for t, keep in zip(ids, own))
    tool_turn = tok.encode(f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{ex.a * ex.b}\n</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n")
    assert targets == f"{call}{'_' * len(tool_turn)}{ex.a * ex.b}<|im_end|>"
    ex, direct = next((e, pair[1]) for e, pair in zip(examples, pairs)
                      if task.reference_conversation(e) is None)
    assert len(pairs[examples.index(ex)]) == 2  # no target flags: every token of an in-head answer is a target
    assert tok.decode(direct) == f"{ex.a}*{ex.b}={ex.a * ex.b}<|im_end|>"  # in its head, the problem restated


def test_full_width_operands_and_the_teachers_share():
    """full_width: both operands in 100..999; teacher_tool_rate 0.3 of 2000 seeded draws: 0.3 +- 3 sigma."""
    from grpo_engine.tasks.arithmetic import ArithmeticOptions, ArithmeticTask

    task = ArithmeticTask(ArithmeticOptions(digits=3, full_width=True, operations=("*",), n_train=2000, n_test=10,
                                            teacher_tool_rate=0.3))
    train = task.examples("train")
    assert all(100 <= ex.a <= 999 and 100 <= ex.b <= 999 for ex in train + task.examples("test"))
    share = sum(task.reference_conversation(ex) is not None for ex in train) / len(train)
    assert abs(share - 0.3) < 3 * (0.3 * 0.7 / 2000) ** 0.5
    assert ArithmeticTask(ArithmeticOptions(digits=3)).reference_conversation(train[0]) is None


def test_demo_tools_is_the_real_models(tmp_path):
    """`grpo demo --tools` is `grpo demo --real --tools`: the same resolved config (SmolLM2 and its calculator
    recipe); a tiny model learns the call only from some inits (docs/tools.md)."""
    from grpo_engine.demo import REAL_TOOLS_RECIPE, demo_config

    overrides = [f"run_dir={tmp_path}"]
    tools = demo_config(overrides, tools=True)
    assert tools == demo_config(overrides, real=True, tools=True)
    assert tools == demo_config(overrides, real=True, tools=True, model=tools.model.path)
    assert tools.model.path.endswith(".gguf") and not tools.warm_start.tiny.arch
    assert tools.task.options == load_config(Path(str(REAL_TOOLS_RECIPE))).task.options


def test_tiny_rope_theta_reaches_the_built_model(tmp_path):
    """warm_start.tiny.rope_theta is written into the tiny base's config; unset, the family's own stays."""
    from grpo_engine.sft.warm_start import build_tiny_base

    def theta(*overrides):
        cfg = load_config(None, ["warm_start.tiny.arch=llama3", "warm_start.tiny.hidden_size=32",
                                 "warm_start.tiny.intermediate_size=64", f"run_dir={tmp_path / str(len(overrides))}",
                                 *overrides])
        return json.loads((build_tiny_base(cfg) / "config.json").read_text())["rope_theta"]

    assert theta() == 500000.0 and theta("warm_start.tiny.rope_theta=1000") == 1000.0
