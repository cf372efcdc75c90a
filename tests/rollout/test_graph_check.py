"""CUDA graphs that check themselves (rollout/static_decode.py), on the CPU with the graph backend faked
(fake_graphs.FakeGraphs): a capture that raises or a replay that differs makes rollout.cuda_graphs=auto decode the
same state eagerly, with outputs equal to an all-eager run's, one warning line and rollout/cuda_graphs_fallback in
metrics.jsonl; `on` raises. Up front: no graphs under FSDP2, every CUDA call on the model's device. And the decode
step traced by torch.compile(fullgraph=True): no host sync or data-dependent branch in what a graph captures."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from fake_graphs import FAULTS, OUT_OF_MEMORY, FakeGraphs

from grpo_engine.config import ConfigError
from grpo_engine.model.loading import load_model
from grpo_engine.model.tiny import tiny_config
from grpo_engine.rollout import SamplingParams, static_decode
from grpo_engine.rollout.generate import generate_static
from grpo_engine.rollout.static_decode import (
    CaptureCheckFailed,
    CudaGraphs,
    cuda_graphs_fallback,
    graphs_for,
    release_static_decode,
    replay_mismatch,
    static_decode_stats,
    static_decoder,
)
from grpo_engine.world import World

WARNING = "warning: rollout.cuda_graphs: capture check failed ({}); decoding eagerly\n"
RAISED = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
STOPS = [262, 152, 270, 198, 8]  # greedy rows of this tiny model end at many steps: the batch steps 16 -> 8 -> ...


def fresh_decoder(model):
    release_static_decode(model)
    return static_decoder(model, 16, 60, 40)


@pytest.mark.parametrize("at", [1, 2])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_check_decodes_the_same_state_eagerly(model64, prompts, capsys, fault, at):
    """The at-th capture fails its check (at=2: mid-call, after bucket 16's graph passed and replayed): the rest
    of the call and later calls decode eagerly; every output equals an all-eager run's exactly (float64), greedy
    and sampled; one warning line names the cause; rollout/cuda_graphs_fallback = 1."""
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS)
    sampled = replace(greedy, temperature=0.8, top_p=0.9)
    eager = [generate_static(model64, prompts, p, seed=[*range(8)]) for p in (greedy, sampled)]
    fake = FakeGraphs.install(fresh_decoder(model64), fault, at)
    capsys.readouterr()
    assert cuda_graphs_fallback() is None
    assert generate_static(model64, prompts, greedy, seed=[*range(8)], graphs=True) == eager[0]
    assert fake.captures == at and static_decode_stats(model64)["captures"] == at - 1
    assert generate_static(model64, prompts, sampled, seed=[*range(8)], graphs=True) == eager[1]
    assert fake.captures == at  # no capture after the fallback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: rollout.cuda_graphs: capture check failed (")
    cause = {"raise": RAISED, "empty": "the replayed chunk's key_mask differ from the eager chunk's",
             "tokens": "the replayed chunk's tokens differ from the eager chunk's",
             "logp": "the replayed chunk's log-probs differ from the eager chunk's by 0.0001 > 1e-05",
             "buffers": "the replayed chunk's positions differ from the eager chunk's"}[fault]
    assert err == WARNING.format(cause)
    assert cuda_graphs_fallback() == 1 and static_decode_stats(model64)["fallback"] == cause


def test_a_passing_check_keeps_the_graph_within_tolerance(model64, prompts, capsys):
    """Log-probs off by less than the tolerance (1e-5 for a float64 / fp32 model) pass: the graphs are kept and
    replayed, nothing is printed, rollout/cuda_graphs_fallback = 0."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS)
    eager = generate_static(model64, prompts, params)
    fake = FakeGraphs.install(fresh_decoder(model64), "logp", at=1, off=1e-7)
    graphed = generate_static(model64, prompts, params, graphs=True)
    assert graphed.completion_ids == eager.completion_ids and fake.captures == 2 and fake.replays > 2
    got, want = (torch.tensor(o.logprobs[0], dtype=torch.float64) for o in (graphed, eager))
    torch.testing.assert_close(got, want, atol=1.1e-7, rtol=0)
    assert graphed.logprobs != eager.logprobs  # the replay's own values were kept
    assert capsys.readouterr().err == "" and cuda_graphs_fallback() == 0


def test_replay_mismatch_tolerances():
    ref = [torch.tensor([[True, False]]), torch.tensor([[3]]), torch.tensor([[4]]), torch.tensor([5]),
           torch.tensor([6]), torch.tensor([[[7.0, 8.0]], [[-1.0, -2.0]], [[-0.5, float("nan")]]], dtype=torch.float64)]
    same = [t.clone() for t in ref]
    assert replay_mismatch(same, ref, 1e-5) is None  # a NaN row (flagged by its token) is equal to itself
    same[-1][1, 0, 0] += 9e-6
    assert replay_mismatch(same, ref, 1e-5) is None
    same[-1][1, 0, 0] += 2e-6
    assert replay_mismatch(same, ref, 1e-5).endswith("log-probs differ from the eager chunk's by 1.1e-05 > 1e-05")
    assert replay_mismatch(same, ref, 1e-3) is None  # bf16's tolerance
    other = [t.clone() for t in ref]
    other[3][0] = 9
    assert replay_mismatch(other, ref, 1e-3) == "the replayed chunk's write differ from the eager chunk's"
    assert static_decode.logp_tolerance(torch.float32) == 1e-5 and static_decode.logp_tolerance(torch.float64) == 1e-5
    assert static_decode.logp_tolerance(torch.bfloat16) == 1e-3 and static_decode.logp_tolerance(torch.float16) == 1e-3


def test_on_raises_and_drops_the_state(model64, prompts, capsys):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS, cuda_graphs="on")
    FakeGraphs.install(fresh_decoder(model64), "empty")
    with pytest.raises(CaptureCheckFailed, match=r"^rollout.cuda_graphs=on: capture check failed \(the replayed "
                       r"chunk's key_mask differ .*\); set rollout.cuda_graphs=auto to decode eagerly"):
        generate_static(model64, prompts, params, graphs=True)
    assert static_decode_stats(model64) is None and capsys.readouterr().err == ""
    FakeGraphs.install(fresh_decoder(model64), "raise")
    with pytest.raises(CaptureCheckFailed, match=f"capture check failed \\({RAISED}\\)"):
        generate_static(model64, prompts, params, graphs=True)
    assert static_decode.HEALTH.cause is None  # `on` never falls back


class Shell(torch.nn.Module):
    """What graphs_for reads of a model: its device (here cuda:1, never touched), its modules and its config's rope."""

    device = torch.device("cuda", 1)

    def __init__(self):
        super().__init__()
        self.block = torch.nn.Linear(2, 2)
        self.config = tiny_config("qwen2")


def test_no_graphs_under_fsdp2():
    """fully_shard makes each unit an FSDPModule (class FSDP<cls>): auto turns graphs off, on refuses."""
    from torch.distributed.fsdp import FSDPModule

    model = Shell()
    assert graphs_for(model, "auto") and graphs_for(model, "on") and not graphs_for(model, "off")
    model.block.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    assert not graphs_for(model, "auto")
    with pytest.raises(ConfigError, match=r"^rollout.cuda_graphs=on cannot capture a model sharded by FSDP2 .*"
                       r"set rollout.cuda_graphs=auto \(or off\)$"):
        graphs_for(model, "on")


class RecordingCUDA:
    """torch.cuda's stream and graph API, recording the current device at each call and each stream's device."""

    def __init__(self, monkeypatch):
        self.current, self.calls = torch.device("cuda", 0), []
        outer = self

        class Stream:
            def __init__(self, device=None):
                self.device = torch.device(device) if device is not None else outer.current
                outer.note("Stream", self.device)

            def wait_stream(self, other):
                outer.note("wait_stream", self.device, other.device)

        class Device:
            def __init__(self, device):
                self.device = torch.device(device)

            def __enter__(self):
                self.before, outer.current = outer.current, self.device

            def __exit__(self, *exc):
                outer.current = self.before

        class Graph:
            def replay(self):
                outer.note("replay")

        def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            outer.note("graph", stream.device)
            return torch.cuda.stream(stream)

        for name, value in (("device", Device), ("Stream", Stream), ("current_stream", Stream),
                            ("stream", lambda s: Device(s.device)), ("CUDAGraph", Graph), ("graph", graph),
                            ("graph_pool_handle", lambda: self.note("graph_pool_handle")),
                            ("synchronize", lambda device=None: self.note("synchronize", torch.device(device))),
                            ("set_stream", lambda s: self.note("set_stream", s.device))):
            monkeypatch.setattr(torch.cuda, name, value)

    def note(self, name, *devices):
        self.calls.append((name, self.current, *devices))


def test_every_cuda_call_runs_on_the_models_device(monkeypatch):
    """A model on cuda:1 while cuda:0 is current: the warm-up, the capture (its stream given, not torch's default
    capture stream, which lives on whichever device was current first), the sync and every replay run under
    torch.cuda.device(cuda:1), on streams of cuda:1; the current device is cuda:0 again after each."""
    cuda = RecordingCUDA(monkeypatch)
    backend, ran = CudaGraphs(torch.device("cuda", 1)), []
    backend.warm_up(lambda: ran.append(cuda.current))
    replay = backend.capture(lambda: ran.append(cuda.current))
    replay()
    replay()
    one = torch.device("cuda", 1)
    assert ran == [one, one] and cuda.current == torch.device("cuda", 0)
    assert [c[0] for c in cuda.calls].count("replay") == 2 and any(c[0] == "graph" for c in cuda.calls)
    assert all(d == one for call in cuda.calls for d in call[1:]), cuda.calls


def test_the_fallback_reaches_metrics_jsonl(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """A training run whose rollout captures graphs (forced on the CPU, the capture raising as a driver might):
    it trains on, one warning line, rollout/cuda_graphs_fallback = 1 on every step's metrics line."""
    import importlib
    from pathlib import Path

    from grpo_engine.config import load_config
    from grpo_engine.train.loop import train
    from grpo_engine.train.metrics import graph_metrics

    assert graph_metrics(World()) == {}  # no capture checked: a CPU run's lines have no such key
    generate_module = importlib.import_module("grpo_engine.rollout.generate")
    monkeypatch.setattr(generate_module, "graphs_for", lambda model, choice: choice != "off")
    resolved_module = importlib.import_module("grpo_engine.plan.resolved")  # Resolved: as if on CUDA too
    monkeypatch.setattr(resolved_module, "cuda_graphs_on", lambda choice, device: choice != "off")
    monkeypatch.setattr(static_decode, "CudaGraphs", lambda device: FakeGraphs(fault="raise"))
    cfg = Path(__file__).resolve().parents[2] / "configs/tiny_arithmetic.yaml"
    run_dir = tmp_path / "run"
    train(load_config(str(cfg), [f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=2"]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["rollout/cuda_graphs_fallback"] for r in rows] == [1, 1]
    assert capsys.readouterr().err.count("rollout.cuda_graphs: capture check failed") == 1


def trace(fn):
    """fn compiled to one graph: a host read (.item(), .tolist(), bool() of a tensor), a data-dependent Python
    branch or shape makes torch.compile(fullgraph=True) raise instead of breaking the graph."""
    return torch.compile(fn, backend="eager", fullgraph=True)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)])
def test_the_decode_step_traces_as_one_graph(tiny_ckpt_factory, sampling):
    """The step a graph captures CHUNK times (StaticDecoder.chunk is a loop of it, j only picking hist's column),
    traced whole (model forward on the bucket's cache, LM head, sampler, advance), gives the eager step's state.
    The sampled case's vocabulary is a multiple of the sampler's block (1,024) because Dynamo refuses the
    sampler's `out=` into the padded work buffer's non-contiguous [:, :V] view (a tracing limit, not a host read:
    a CUDA capture records it as any other kernel); greedy is traced at the usual 272."""
    vocab = 1024 if sampling["temperature"] else 272
    model = load_model(tiny_ckpt_factory("qwen2", vocab_size=vocab), dtype=torch.float32)
    torch._dynamo.reset()
    with torch.inference_mode():
        decoder = static_decoder(model, 4, 64, 40)
        state, sample = decoder.state, decoder.token_sampler(SamplingParams(**sampling))
        state.key_mask[:, :3] = True
        state.key_mask[:, state.slots] = True
        state.write.fill_(3)
        state.positions.fill_(3)
        state.ids[:, 0] = torch.tensor([5, 17, 99, 200])
        state.uniforms.uniform_(generator=torch.Generator().manual_seed(0))
        state.col.fill_(1)
        before = [t.clone() for t in (*state.step_buffers(), state.hist, *state.k, *state.v)]
        decoder.step(model, 4, sample, 1)
        eager = [t.clone() for t in (*state.step_buffers(), state.hist, *state.k, *state.v)]
        for t, s in zip((*state.step_buffers(), state.hist, *state.k, *state.v), before):
            t.copy_(s)
        trace(lambda: decoder.step(model, 4, sample, 1))()
        for got, want in zip((*state.step_buffers(), state.hist, *state.k, *state.v), eager):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert not torch.equal(eager[0], before[0])  # the step did advance the rows
    release_static_decode(model)
    torch._dynamo.reset()


OOM_CAUSE = {"oom_warm_up": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
             "oom_capture": "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB"}


@pytest.mark.parametrize("fault", OUT_OF_MEMORY)
def test_out_of_memory_leaves_only_its_bucket_eager_and_the_smaller_ones_captured(model64, prompts, capsys, fault):
    """The first warm-up or capture (bucket 16) runs out of memory: its memory is freed, bucket 16 decodes eagerly,
    the rows' next buckets (8, 4, ...) are captured and replayed; outputs equal an all-eager run's; one warning line
    per failed bucket; the process keeps its graphs (HEALTH.cause stays None) and the metric says a bucket fell
    back. A second call at bucket 16 stays eager without another attempt."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS)
    eager = generate_static(model64, prompts, params, seed=[*range(8)])
    fake = FakeGraphs.install(fresh_decoder(model64), fault, at=1)
    capsys.readouterr()
    assert generate_static(model64, prompts, params, seed=[*range(8)], graphs=True) == eager
    stats = static_decode_stats(model64)
    assert fake.released == 1 and stats["eager_from_bucket"] == 16
    assert stats["out_of_memory"] == {16: OOM_CAUSE[fault]} and stats["fallback"] is None
    assert stats["captures"] == 1 and stats["buckets"] == [8] and fake.replays >= 2, stats
    assert static_decode.HEALTH.cause is None and cuda_graphs_fallback() == 1
    err = capsys.readouterr().err
    assert err == (f"warning: rollout.cuda_graphs: out of memory capturing the 16-row bucket ({OOM_CAUSE[fault]}); "
                   "it decodes eagerly, smaller buckets keep their graphs\n")
    attempts = fake.warm_ups
    assert generate_static(model64, prompts, params, seed=[*range(8)], graphs=True) == eager
    assert fake.warm_ups == attempts  # bucket 16 eager, the smaller ones replayed: nothing captured again


def test_out_of_memory_again_at_the_smaller_bucket_leaves_that_one_eager_too(model64, prompts, capsys):
    """Buckets 16 and then 8 (the rows' buckets here) run out of memory in their captures: both decode eagerly, each
    tried once, each freed; the process-wide fallback stays unset."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS)
    eager = generate_static(model64, prompts, params, seed=[*range(8)])
    fake = FakeGraphs.install(fresh_decoder(model64), "oom_capture", at=(1, 2))
    assert generate_static(model64, prompts, params, seed=[*range(8)], graphs=True) == eager
    stats = static_decode_stats(model64)
    assert stats["eager_from_bucket"] == 8 and sorted(stats["out_of_memory"]) == [8, 16] and fake.released == 2
    assert stats["buckets"] == [] and fake.captures == 2 and static_decode.HEALTH.cause is None
    assert capsys.readouterr().err.count("out of memory capturing") == 2


def test_on_raises_on_out_of_memory(model64, prompts):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS, cuda_graphs="on")
    FakeGraphs.install(fresh_decoder(model64), "oom_capture")
    with pytest.raises(CaptureCheckFailed, match="capture check failed \\(OutOfMemoryError: CUDA out of memory"):
        generate_static(model64, prompts, params, graphs=True)
