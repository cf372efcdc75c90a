"""Curriculum (collect/curriculum.py): config checks, selection on hand-made scores, the queue in front of the
prompt stream, and an exact resume of a tiny run with the curriculum on."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpo_engine.collect.curriculum import Curriculum, PoolScores, difficulty, easy_to_hard, in_band, pool_seed, select
from grpo_engine.collect.groups import ShuffledPrompts, prompt_seed
from grpo_engine.config import ConfigError, CurriculumSection, load_config
from grpo_engine.model.loading import load_model
from grpo_engine.train.loop import train

REPO = Path(__file__).resolve().parents[2]
CFG = str(REPO / "configs/tiny_arithmetic.yaml")
HERE = Path(__file__).resolve().parent
VOLATILE = ("time_", "tokens_per_s", "peak_mem")


# 1. config -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("curriculum.mode=semantic", "did you mean 'semantic_entropy'"),
    ("curriculum.every=0", "curriculum.every=0 must be >= 1"),
    ("curriculum.pool_size=0", "curriculum.pool_size=0 must be >= 1"),
    ("curriculum.samples=1", "curriculum.samples=1 must be >= 2"),
    ("curriculum.max_new_tokens=-1", "curriculum.max_new_tokens=-1 must be >= 0"),
    ("curriculum.entropy_weight=1.5", "curriculum.entropy_weight=1.5 must be in [0, 1]"),
    ("curriculum.band_low=0.95", "need 0 <= band_low <= band_high <= 1"),
    ("curriculum.band_high=1.2", "need 0 <= band_low <= band_high <= 1"),
])
def test_bad_curriculum_values_are_config_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(CFG, [override])
    assert message in str(e.value)


def test_curriculum_defaults_are_off():
    c = load_config(CFG, []).curriculum
    assert (c.mode, c.every, c.pool_size, c.samples, c.band_low, c.band_high) == ("none", 10, 32, 4, 0.1, 0.9)


# 2. selection on hand-made scores ---------------------------------------------------------------------------------

SCORES = PoolScores(indices=[10, 11, 12, 13, 14],
                    accuracy=[0.0, 1.0, 0.5, 0.25, 1.0],
                    entropy=[0.0, 0.0, 1.0, 0.5, 0.5])


def test_difficulty_mixes_entropy_and_inaccuracy():
    assert difficulty(SCORES, 0.5) == [0.5, 0.0, 0.75, 0.625, 0.25]
    assert difficulty(SCORES, 0.0) == [1.0, 0.0, 0.5, 0.75, 0.0]  # 1 - accuracy
    assert difficulty(SCORES, 1.0) == [0.0, 0.0, 1.0, 0.5, 0.5]  # entropy


def test_easy_to_hard_orders_by_difficulty_ties_in_pool_order():
    assert easy_to_hard(SCORES, 0.5) == [11, 14, 10, 13, 12]
    assert easy_to_hard(SCORES, 0.0) == [11, 14, 12, 13, 10]
    assert easy_to_hard(SCORES, 1.0) == [10, 11, 13, 14, 12]


def test_band_keeps_accuracies_inside_inclusive_bounds():
    assert in_band(SCORES, 0.1, 0.9) == [12, 13]
    assert in_band(SCORES, 0.25, 1.0) == [11, 12, 13, 14]
    assert in_band(SCORES, 0.3, 0.4) == []
    assert select(SCORES, CurriculumSection(mode="accuracy_band", band_low=0.0, band_high=0.0)) == [10]
    assert select(SCORES, CurriculumSection(mode="semantic_entropy")) == [11, 14, 10, 13, 12]


def test_pool_seeds_differ_from_training_seeds():
    pool = {pool_seed(0, s, i) for s in range(1, 20) for i in range(64)}
    train_seeds = {prompt_seed(0, s, r, i) for s in range(1, 20) for r in range(4) for i in range(64)}
    assert len(pool) == 19 * 64 and not pool & train_seeds


# 3. the queue in front of the stream -----------------------------------------------------------------------------

class FakeScorer:
    """Scores a pool from a fixed table of accuracies per example; records the pools it saw."""

    def __init__(self, accuracy: dict[int, float]):
        self.accuracy, self.pools = accuracy, []

    def score(self, model, pool, step):
        self.pools.append((step, list(pool)))
        acc = [self.accuracy[i] for i in pool]
        return PoolScores(list(pool), acc, [0.0] * len(pool)), 7


def test_curriculum_serves_its_queue_then_the_stream_and_rescores_every_k():
    stream = ShuffledPrompts(8, seed=3)
    plain = ShuffledPrompts(8, seed=3)
    order = [plain.next() for _ in range(16)]  # the plain stream's first two epochs
    acc = {i: i / 8 for i in range(8)}  # example i has accuracy i / 8
    cfg = CurriculumSection(mode="accuracy_band", every=3, pool_size=4, band_low=0.2, band_high=0.8)
    scorer = FakeScorer(acc)
    cur = Curriculum(cfg, stream, scorer)
    report = cur.refresh(1, model=None)
    assert scorer.pools == [(1, order[:4])]
    queued = [i for i in order[:4] if 0.2 <= i / 8 <= 0.8]
    assert cur.queue == queued and report.queued == len(queued) and report.gen_tokens == 7
    assert report.accuracy == pytest.approx(sum(acc[i] for i in order[:4]) / 4)
    assert cur.refresh(2, model=None) is None and cur.refresh(3, model=None) is None  # due again at 1 + 3
    served = [cur.next() for _ in range(len(queued) + 2)]
    assert served == queued + order[4:6] and cur.position == 6
    # a re-scoring pools what is still queued first, then fresh prompts from the stream
    cur.queue = [order[0]]
    cur.refresh(4, model=None)
    assert scorer.pools[-1] == (4, [order[0]] + order[6:9]) and cur.next_rescore == 7


def test_empty_band_falls_back_to_the_stream_and_state_round_trips():
    stream = ShuffledPrompts(8, seed=0)
    cfg = CurriculumSection(mode="accuracy_band", every=2, pool_size=3, band_low=0.9, band_high=1.0)
    cur = Curriculum(cfg, stream, FakeScorer({i: 0.0 for i in range(8)}))
    cur.refresh(1, model=None)
    assert cur.queue == [] and cur.next() == ShuffledPrompts(8, seed=0, position=3).next()
    cur.queue = [5, 2]
    state = json.loads(json.dumps(cur.state_dict()))  # JSON-friendly
    again = Curriculum(cfg, ShuffledPrompts(8, seed=0, position=cur.position), FakeScorer({}), state)
    assert (again.queue, again.next_rescore, again.position) == ([5, 2], 3, 4)
    assert [again.next() for _ in range(3)] == [5, 2, cur.stream.next()]


# 4. end to end: a tiny run with the curriculum on, and its exact resume ------------------------------------------

def curriculum_config(tmp_path, monkeypatch) -> str:
    """tiny_arithmetic.yaml with a custom task whose "answer" is the completion's first character (correct when
    even), so pooled prompts differ in accuracy and entropy and the rewards vary (the weights move)."""
    monkeypatch.syspath_prepend(str(HERE))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(12)))
    cfg = yaml.safe_load(Path(CFG).read_text())
    cfg["task"] = {"name": "custom", "options": {"data_path": str(data), "reward_fn": "reward_fns:first_char",
                                                 "system_prompt": None, "prefill": ""}}
    cfg["curriculum"] = {"mode": "semantic_entropy", "every": 2, "pool_size": 4, "samples": 3}
    path = tmp_path / "curriculum.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _metrics(run_dir):
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["semantic_entropy", "accuracy_band"])
def test_curriculum_run_resumes_bit_for_bit(tmp_path, tiny_ckpt, monkeypatch, mode):
    custom = curriculum_config(tmp_path, monkeypatch)
    over = [f"model.path={tiny_ckpt}", "schedule.steps=4", "rollout.max_new_tokens=4", "logging.samples_every=0",
            f"curriculum.mode={mode}"]
    train(load_config(custom, over + [f"run_dir={tmp_path / 'a'}"]))
    split = load_config(custom, over + [f"run_dir={tmp_path / 'b'}"])
    assert train(split, stop_after=1).stopped_by == "stop_after"  # mid-queue: up to 4 queued, 2 served
    strip = lambda rows: [{k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in rows]  # noqa: E731
    queued = _metrics(tmp_path / "b")[0]["curriculum_queued"]
    state = json.loads((tmp_path / "b/checkpoints/step-000001/trainer_state.json").read_text())
    assert state["curriculum"]["next_rescore"] == 3 and len(state["curriculum"]["queue"]) == max(0, queued - 2)
    assert train(split, resume="latest").stopped_by == "completed"
    a, b = strip(_metrics(tmp_path / "a")), strip(_metrics(tmp_path / "b"))
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a == b
    # re-scored at steps 1 and 3 (every=2), 4 prompts x 3 samples x <= 4 tokens; semantic_entropy queues the
    # whole pool, accuracy_band those with 1 or 2 of 3 samples correct
    if mode == "semantic_entropy":
        assert [r["curriculum_queued"] for r in a] == [4, 0, 4, 0]
    else:
        assert all(r["curriculum_queued"] <= 4 for r in a) and a[1]["curriculum_queued"] == 0
    for r in (a[0], a[2]):
        assert 0.0 <= r["curriculum_pool_accuracy"] <= 1.0 and 0.0 <= r["curriculum_pool_entropy"] <= 1.0
        assert 4 * 3 <= r["curriculum_gen_tokens"] <= 4 * 3 * 4
    assert a[1]["curriculum_pool_accuracy"] is None  # NaN in the dataclass, null in strict JSON
    assert any(r["reward_std"] > 0 for r in a) and not math.isnan(a[-1]["loss"])
    wa = load_model(tmp_path / "a/checkpoints/step-000004/model").state_dict()
    wb = load_model(tmp_path / "b/checkpoints/step-000004/model").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _cli_train(config: str, args: list[str], run_dir: Path, ranks: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    cmd = [sys.executable, "-m", "grpo_engine.cli", "train", config, f"run_dir={run_dir}", *args]
    out = subprocess.run(cmd + ([f"--nproc={ranks}"] if ranks > 1 else []), cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-6000:]
    return _metrics(run_dir)


@pytest.mark.slow
def test_two_ranks_score_the_pool_and_queue_like_one_process(tmp_path, tiny_ckpt, monkeypatch):
    """Under torchrun each rank scores every 2nd pooled prompt (an odd pool: uneven shares); the gathered scores,
    the queue and so the prompts trained on are those of one process."""
    custom = curriculum_config(tmp_path, monkeypatch)
    args = [f"model.path={tiny_ckpt}", "schedule.steps=3", "rollout.prompts_per_step=4", "rollout.max_new_tokens=4",
            "curriculum.pool_size=5", "distributed.strategy=ddp"]
    one = _cli_train(custom, args, tmp_path / "one", 1)
    two = _cli_train(custom, args, tmp_path / "two", 2)
    keys = ("curriculum_pool_accuracy", "curriculum_pool_entropy", "curriculum_queued", "curriculum_gen_tokens")
    assert [[r[k] for k in keys] for r in two] == [[r[k] for k in keys] for r in one]
    assert [r["curriculum_queued"] for r in one] == [5, 0, 5]
    assert [r["reward_mean"] for r in two] == pytest.approx([r["reward_mean"] for r in one], rel=1e-5)
