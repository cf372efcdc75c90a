"""distributed.strategy=auto is resolved once (plan/policy_spec.py sharding), by the run (train/distributed.py
init_world) and by the planner alike: a run that auto-picks FSDP2 is planned without the static decode state it
does not build."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from grpo_engine.config import load_config
from grpo_engine.model.tiny import tiny_config
from grpo_engine.plan.from_config import plan_config
from grpo_engine.plan.memory import param_counts
from grpo_engine.plan.policy_spec import AUTO_FSDP2_SHARE, sharding
from grpo_engine.train.distributed import init_world

TINY = ["warm_start.tiny.arch=qwen2", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_prompt_tokens=32", "rollout.max_new_tokens=16"]


def _state_bytes(cfg) -> float:
    """Weights + gradients + (master +) AdamW moments of the full fine-tune: 16 B a parameter either precision."""
    return param_counts(tiny_config("qwen2", **cfg.warm_start.tiny.shape()))[0] * 16


def test_auto_is_none_alone_ddp_where_the_state_fits_and_fsdp2_where_it_does_not():
    cfg = load_config(None, TINY)
    state = _state_bytes(cfg)
    params = lambda: param_counts(tiny_config("qwen2", **cfg.warm_start.tiny.shape()))[0]  # noqa: E731
    assert sharding(cfg, params, ranks=1, card_bytes=1) == "none"
    assert sharding(cfg, params, ranks=2, card_bytes=None) == "ddp"  # no card: the CPU's gloo ranks
    assert sharding(cfg, params, ranks=2, card_bytes=int(state / AUTO_FSDP2_SHARE) + 1) == "ddp"
    assert sharding(cfg, params, ranks=2, card_bytes=int(state / AUTO_FSDP2_SHARE) - 1000) == "fsdp2"
    assert sharding(load_config(None, [*TINY, "lora.enabled=true"]), params, ranks=2, card_bytes=1) == "ddp"
    assert sharding(load_config(None, [*TINY, "distributed.strategy=ddp"]), params, ranks=2, card_bytes=1) == "ddp"


@pytest.fixture
def small_card(monkeypatch):
    """Two torchrun ranks on a CUDA card too small for the tiny model's full training state."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=4096))
    for name, value in {"is_initialized": True, "get_rank": 0, "get_world_size": 2}.items():
        monkeypatch.setattr(dist, name, lambda v=value: v)


def test_the_run_and_the_plan_agree_on_the_strategy_auto_picks(small_card):
    """The run auto-picks FSDP2 on the small card; the plan then counts no static decode state (FSDP2 decodes on
    a state of each call's own, eagerly), as it does for distributed.strategy=fsdp2 asked for by name."""
    cfg = load_config(None, [*TINY, "distributed.backend=gloo", "model.device=cuda", "memory.precision=fp32"])
    assert init_world(cfg).strategy == "fsdp2"
    plan = plan_config(cfg, shape="qwen2.5-0.5b")
    assert plan.decode is None
    named = plan_config(load_config(None, [*TINY, "distributed.strategy=fsdp2", "memory.precision=fp32"]),
                        shape="qwen2.5-0.5b")
    assert plan.phase("rollout").components == named.phase("rollout").components


def test_one_process_plans_the_static_decode_under_auto(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert plan_config(load_config(None, TINY), shape="qwen2.5-0.5b").decode is not None


def _floor(requirements: list[str], name: str) -> tuple[int, ...]:
    spec = next(r for r in requirements if r.split(">=")[0].strip() == name)
    return tuple(int(x) for x in spec.split(">=")[1].split(",")[0].split("."))


def test_the_floors_cover_what_the_code_calls():
    """FSDP2's public fully_shard / FSDPModule (train/distributed.py): torch 2.6; from_pretrained(dtype=...)
    (benchmarks/gpu_check.py, benchmarks/generate_vs_hf.py, the parity tests): transformers 4.56."""
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert _floor(project["dependencies"], "torch") >= (2, 6)
    for extra in ("bench", "dev"):
        assert _floor(project["optional-dependencies"][extra], "transformers") >= (4, 56)


def test_resolved_records_the_strategy_and_backend_the_run_joins_with(small_card, monkeypatch):
    """Resolved's strategy and backend are the ones init_world joins with (the same functions, policy_spec.py), and
    with FSDP2 chosen by auto Resolved turns the decode's CUDA graphs off (FSDP2 units decode eagerly)."""
    from grpo_engine.plan.resolved import resolve_settings

    joined = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda rank: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: joined.update(backend=backend))
    cfg = load_config(None, [*TINY, "model.device=cuda", "memory.precision=fp32", "memory.gpu_memory_gib=80"])
    world = init_world(cfg)
    resolved = resolve_settings(cfg, torch.device("cuda", 0))
    assert resolved.strategy == world.strategy == "fsdp2"
    assert resolved.backend == joined["backend"] == "nccl"
    assert resolved.config.rollout.cuda_graphs == "off"
