"""Kernel plans: chosen by measurement per weight shape, cached per (CPU, torch, threads), forced off by an
environment variable, recorded in the run folder and checkpoints, and reused on resume."""

import json

import pytest
import torch

from grpo_engine.kernels import KernelPlan, onednn, packed, select
from grpo_engine.kernels.cpu import describe_cpu
from grpo_engine.kernels.select import choose_plan, shape_key, weight_shapes
from grpo_engine.model.loading import load_model


@pytest.fixture(autouse=True)
def _measurement_not_forced_off(monkeypatch):
    """These tests drive the measurement themselves: a GRPO_KERNELS=torch or GRPO_ONEDNN=0 in the environment that
    runs the suite (to test the plain-torch path everywhere else) must not force their plans; each test that wants
    a forced plan sets the variable itself."""
    for name in ("GRPO_KERNELS", "GRPO_ONEDNN", "GRPO_THREADS"):
        monkeypatch.delenv(name, raising=False)
    # a busy host (other work beside the suite) leaves a measured thread count out of the cache, so a test's second
    # plan would measure again: the caching these tests check is that of a quiet host
    monkeypatch.setattr(select.thread_choice.os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def _fake_times(faster: dict[str, str], calls: list):
    """measure_shape stand-in: the backend named in `faster` (by shape key) is the quicker one."""
    def measure(out_features, in_features):
        calls.append((out_features, in_features))
        win = faster.get(shape_key((out_features, in_features)), "torch")
        return {"torch": 1.0 if win == "torch" else 2.0, "onednn": 1.0 if win == "onednn" else 2.0}
    return measure


def test_plan_follows_measurement_and_is_cached(tiny_ckpt, tmp_path, monkeypatch):
    model = load_model(tiny_ckpt)
    shapes = weight_shapes(model)
    assert len(shapes) >= 3
    faster = {shape_key(shapes[0]): "onednn"}
    calls, attention_calls = [], []
    monkeypatch.setattr(select, "measure_shape", _fake_times(faster, calls))
    monkeypatch.setattr(select, "measure_attention", lambda key: attention_calls.append(key) or "grouped")
    packing_calls = []
    monkeypatch.setattr(select, "measure_packing",  # packing (by MKL) pays against oneDNN's plain product only
                        lambda o, i, gemm: packing_calls.append((o, i, gemm)) or ((7, "mkl") if gemm == "onednn"
                                                                                   else (0, "")))
    grad_calls = []
    monkeypatch.setattr(select, "measure_weight_grad",  # in place for the torch weights, not for the oneDNN one
                        lambda o, i, backend: grad_calls.append((o, i, backend)) or ("inplace" if backend == "torch"
                                                                                       else backend))
    input_calls = []
    monkeypatch.setattr(select, "measure_grad_input",  # the oneDNN weight's input gradient measured on torch
                        lambda o, i, backend: input_calls.append((o, i, backend)) or "torch")
    monkeypatch.setattr(onednn, "op_works", lambda: True)
    monkeypatch.setattr(packed, "available", lambda dtype=torch.float32: ["onednn", "mkl"])
    cache = tmp_path / "kernels.json"
    plan = choose_plan(model, cache)
    assert plan.source == "measured" and sorted(calls) == shapes
    assert plan.gemm == {shape_key(s): faster.get(shape_key(s), "torch") for s in shapes}
    c = model.config
    heads = f"{c.num_attention_heads}/{c.num_key_value_heads}/{c.head_dim}"
    assert attention_calls == [heads] and plan.attention == {heads: "grouped"}
    assert sorted(packing_calls) == sorted((*s, plan.gemm[shape_key(s)]) for s in shapes)  # against its own GEMM
    assert plan.decode_packing == {shape_key(shapes[0]): 7}  # weights it never pays for are not listed
    assert plan.pack_kinds == {shape_key(shapes[0]): "mkl"} and plan.pack_kind(shapes[0]) == "mkl"
    assert sorted(grad_calls) == sorted((*s, plan.gemm[shape_key(s)]) for s in shapes)  # each on its own GEMM
    assert plan.weight_grad == {shape_key(s): "onednn" if s == shapes[0] else "inplace" for s in shapes}
    assert not plan.grad_in_place(shapes[0]) and plan.grad_in_place(shapes[1])
    assert sorted(input_calls) == sorted((*s, plan.gemm[shape_key(s)]) for s in shapes)
    assert plan.grad_input == {shape_key(s): "torch" for s in shapes}
    assert plan.backend(shapes[0]) == "onednn" and plan.grad_input_backend(shapes[0]) == "torch"
    stored = json.loads(cache.read_text())
    key = next(k for k in stored if not k.startswith(("decode ", "weight ")))
    attention_key, packing_key = (next(k for k in stored if k.startswith(p)) for p in ("decode a", "decode p"))
    assert select.cpu_model() in key and torch.__version__ in key and stored[key] == plan.gemm
    assert attention_key == f"decode attention | {key}" and stored[attention_key] == plan.attention
    assert packing_key == f"decode packing per weight and kind | {key}"  # never paying recorded as 0
    assert stored[packing_key] == {shape_key(s): [7, "mkl"] if s == shapes[0] else [0, ""] for s in shapes}
    assert stored[f"weight grad | {key}"] == plan.weight_grad and stored[f"grad input | {key}"] == plan.grad_input
    again = choose_plan(model, cache)
    assert (again.source, again.gemm, again.attention) == ("cache", plan.gemm, plan.attention)
    assert (again.decode_packing, again.pack_kinds, again.weight_grad) == (plan.decode_packing, plan.pack_kinds,
                                                                            plan.weight_grad)
    assert again.grad_input == plan.grad_input
    n = len(shapes)  # nothing measured again
    assert (len(calls), len(attention_calls), len(packing_calls), len(grad_calls), len(input_calls)) == (n, 1, n, n, n)

    del stored[f"grad input | {key}"]  # a cache written before input gradients were planned: only they are measured
    cache.write_text(json.dumps(stored))
    assert choose_plan(model, cache).grad_input == plan.grad_input
    assert (len(calls), len(grad_calls), len(input_calls)) == (n, n, 2 * n)


@pytest.mark.parametrize("buffered, fresh, chosen", [(1.0, 2.0, "torch"), (2.0, 1.0, "onednn")])
def test_the_log_prob_head_is_timed_as_it_runs_and_recorded(buffered, fresh, chosen, tiny_ckpt, tmp_path,
                                                            monkeypatch):
    """The chunked log-prob head's forward is timed with torch's product into a reused buffer against oneDNN's
    fresh output (one of the head's shape), only for a head whose GEMM is oneDNN; the choice is cached, kept in
    the plan's JSON and reused."""
    timed = iter([(buffered, fresh)])
    with monkeypatch.context() as m:
        m.setattr(select, "race", lambda fns, reps=3: dict(zip(fns, next(timed))))
        assert select.measure_logprob_head(300, 16, "onednn") == chosen
        assert select.measure_logprob_head(300, 16, "torch") == "torch"  # nothing timed: `timed` is spent
    model = load_model(tiny_ckpt)
    head = select.head_shape(model, weight_shapes(model))
    assert head == tuple(model.lm_head.weight.shape)
    faster = {shape_key(head): "onednn"}
    monkeypatch.setattr(select, "measure_shape", _fake_times(faster, []))
    monkeypatch.setattr(select, "measure_attention", lambda key: "sdpa")
    monkeypatch.setattr(select, "measure_packing", lambda o, i, gemm: (0, ""))
    monkeypatch.setattr(select, "measure_weight_grad", lambda o, i, backend: backend)
    monkeypatch.setattr(select, "measure_grad_input", lambda o, i, backend: backend)
    head_calls, grad_calls = [], []
    monkeypatch.setattr(select, "measure_logprob_head", lambda v, d, backend: head_calls.append((v, d, backend))
                        or chosen)
    blocked = "blocked" if chosen == "onednn" else "inplace"
    monkeypatch.setattr(select, "measure_head_weight_grad", lambda v, d, backend: grad_calls.append((v, d, backend))
                        or blocked)
    monkeypatch.setattr(onednn, "op_works", lambda: True)
    cache = tmp_path / "kernels.json"
    plan = choose_plan(model, cache)
    assert head_calls == [(*head, "onednn")] and plan.logprob_head == {shape_key(head): chosen}
    assert grad_calls == [(*head, "onednn")] and plan.head_weight_grad == {shape_key(head): blocked}
    assert plan.logprob_head_backend(head) == chosen and plan.backend(head) == "onednn"
    assert plan.head_weight_grad_backend(head) == blocked
    again = KernelPlan.from_json(plan.to_json(), "checkpoint")
    assert (again.logprob_head, again.head_weight_grad) == (plan.logprob_head, plan.head_weight_grad)
    cached = choose_plan(model, cache)
    assert (cached.logprob_head, cached.head_weight_grad) == (plan.logprob_head, plan.head_weight_grad)
    assert (len(head_calls), len(grad_calls)) == (1, 1)  # from the cache
    older = json.loads(plan.to_json())
    del older["logprob_head"], older["head_weight_grad"]  # a plan recorded before: as it ran then
    older_plan = KernelPlan.from_json(json.dumps(older), "checkpoint")
    assert older_plan.logprob_head_backend(head) == "onednn" and older_plan.head_weight_grad_backend(head) == "inplace"
    stored = json.loads(cache.read_text())  # a cache written before the head's weight gradient was planned
    for k in [k for k in stored if k.startswith("logprob head weight grad |")]:
        del stored[k]
    cache.write_text(json.dumps(stored))
    assert choose_plan(model, cache).head_weight_grad == plan.head_weight_grad
    assert (len(head_calls), len(grad_calls)) == (1, 2)  # only it measured


@pytest.mark.parametrize("seconds,choice", [((1.0, 0.5), "blocked"), ((1.0, 0.99), "inplace"),
                                            ((0.5, 1.0), "inplace")])
def test_head_weight_gradient_is_timed_in_place_against_onednn_blocks(seconds, choice, monkeypatch):
    """measure_head_weight_grad races torch's addmm_ into the gradient against onednn.blocked_weight_grad on a
    log-prob chunk (HEAD_ROWS rows); the blocks only when ONEDNN_GAIN faster; a head on torch's GEMM stays in place,
    untimed."""
    timed = iter([seconds])
    monkeypatch.setattr(select, "race", lambda fns, reps=3: dict(zip(fns, next(timed))))  # (in place, blocks)
    assert select.measure_head_weight_grad(300, 16, "onednn") == choice
    assert select.measure_head_weight_grad(300, 16, "torch") == "inplace"  # `timed` is spent: nothing timed


def test_forced_torch_and_the_active_plan_decide_applies(tiny_ckpt, tmp_path, monkeypatch):
    model = load_model(tiny_ckpt)
    monkeypatch.setenv("GRPO_KERNELS", "torch")
    forced = choose_plan(model, tmp_path / "k.json")
    assert forced.source == "forced" and set(forced.gemm.values()) == {"torch"}
    x = torch.randn(3, model.config.hidden_size)
    w = model.layers[0].mlp.up_proj.weight
    onednn_plan = KernelPlan("cpu", torch.__version__, 1, {shape_key(tuple(w.shape)): "onednn"})
    assert onednn.applies(x, w, onednn_plan) == onednn.op_works()
    torch_plan = KernelPlan("cpu", torch.__version__, 1, {shape_key(tuple(w.shape)): "torch"})
    assert not onednn.applies(x, w, torch_plan)


def test_run_folder_and_checkpoint_record_the_plan_and_resume_reuses_it(tiny_ckpt, tmp_path, monkeypatch):
    from grpo_engine.config import load_config
    from grpo_engine.train import policy as policy_mod
    from grpo_engine.train.loop import train

    cfg = lambda: load_config(None, [f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'run'}",  # noqa: E731
                                     "schedule.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                     "rollout.max_new_tokens=4", "task.options.n_train=8",
                                     "model.device=cpu"])  # kernel plans are CPU plans
    result = train(cfg(), stop_after=1)
    recorded = KernelPlan.from_json((tmp_path / "run" / "kernels.json").read_text(), "run")
    in_checkpoint = KernelPlan.from_json((result.checkpoint / "kernels.json").read_text(), "ckpt")
    assert in_checkpoint.gemm == recorded.gemm and recorded.gemm
    flipped = {k: ("torch" if v == "onednn" else "onednn") for k, v in recorded.gemm.items()}
    monkeypatch.setattr(policy_mod, "choose_plan", lambda model: KernelPlan("x", "y", 1, flipped))
    seen = []
    real_build = policy_mod.build_policy
    monkeypatch.setattr("grpo_engine.train.setup.build_policy",
                        lambda *a, **k: seen.append(real_build(*a, **k)) or seen[-1])
    train(cfg(), resume="latest")
    assert seen[0].kernel_plan.source == "checkpoint" and seen[0].kernel_plan.gemm == recorded.gemm



def test_resume_measures_again_on_another_cpu_or_torch(tiny_ckpt, tmp_path, monkeypatch):
    """A checkpoint's plan is reused only where it was measured: elsewhere it is not the fast plan (another
    machine's threads and GEMMs) and cannot repeat the run bit for bit anyway, so it is measured again, loudly."""
    from grpo_engine.train import policy as policy_mod

    model = load_model(tiny_ckpt)
    measured = KernelPlan("here", torch.__version__, 1, {"1x1": "torch"}, "measured")
    monkeypatch.setattr(policy_mod, "choose_plan", lambda m: measured)
    monkeypatch.setattr(select, "cpu_model", lambda: "AMD EPYC (cpu family 25, model 1, stepping 1; avx2)")
    monkeypatch.setattr(policy_mod, "cpu_model", select.cpu_model)

    def resumed(cpu: str, torch_version: str = torch.__version__) -> KernelPlan:
        (tmp_path / "kernels.json").write_text(KernelPlan(cpu, torch_version, 2, {"1x1": "onednn"}).to_json())
        return policy_mod.kernel_plan(model, tmp_path)

    assert resumed(select.cpu_model()).source == "checkpoint"
    assert resumed("AMD EPYC").source == "checkpoint"  # recorded before CPUs were described in full
    for cpu, version in (("AMD EPYC (cpu family 25, model 17, stepping 1; avx2 avx512f)", torch.__version__),
                         ("AMD EPYC", "0.0.0")):
        with pytest.warns(UserWarning, match="measuring this machine's plan"):
            assert resumed(cpu, version) is measured


def test_onednn_is_chosen_only_when_measurably_faster():
    """Level timings (an Intel Xeon's MKL, a noisy host) must give plain torch, not a coin flip per shape."""
    assert select.faster_gemm({"torch": 1.0, "onednn": 0.99}) == "torch"  # 1% is within timer noise
    assert select.faster_gemm({"torch": 1.0, "onednn": 1.01}) == "torch"
    assert select.faster_gemm({"torch": 1.0, "onednn": 0.9}) == "onednn"
    assert select.faster_gemm({"torch": 1.0}) == "torch"  # no working oneDNN op: nothing else timed

# ------------------------------------------------------------------------------------------ thread count
def test_thread_candidates_and_the_pick_rule():
    from grpo_engine.kernels.threads import candidates, pick

    assert [candidates(n) for n in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]
    assert pick({1: 1.0, 2: 0.6, 4: 0.5}) == 4  # more threads, faster: all of them
    assert pick({1: 0.5, 2: 0.9}) == 1  # 0.5 < 0.95 x 0.9: fewer threads win
    assert pick({1: 0.88, 2: 0.9}) == 2  # within 5% of the largest count: keep it
    assert pick({1: 0.9, 2: 0.4, 4: 0.8}) == 2


def test_user_fixed_thread_count(monkeypatch):
    from grpo_engine.kernels.threads import fixed_threads

    monkeypatch.setenv("GRPO_THREADS", "3")
    assert fixed_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("GRPO_THREADS", bad)
        with pytest.raises(ValueError, match="GRPO_THREADS"):
            fixed_threads()
    monkeypatch.delenv("GRPO_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert fixed_threads() == torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert fixed_threads() is None


def test_plan_measures_threads_first_times_gemms_at_that_count_and_applies_it(tiny_ckpt, tmp_path, monkeypatch):
    from grpo_engine.kernels import apply_kernels, threads

    model = load_model(tiny_ckpt)
    monkeypatch.delenv("GRPO_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "AVAILABLE", 4)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.2, 1.0, 1.0))  # only this process: a quiet machine
    timed_counts = []
    monkeypatch.setattr(threads, "measure", lambda counts, fn: timed_counts.append(counts) or {1: 1.0, 2: 1.5, 4: 2.0})
    gemm_threads = []
    monkeypatch.setattr(select, "measure_shape",
                        lambda o, i: gemm_threads.append(torch.get_num_threads()) or {"torch": 1.0, "onednn": 2.0})
    monkeypatch.setattr(onednn, "op_works", lambda: True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plan = choose_plan(model, tmp_path / "k.json")
        assert timed_counts == [[1, 2, 4]] and plan.threads == 1
        assert set(gemm_threads) == {1} and torch.get_num_threads() == 2  # timed at 1, restored after
        stored = json.loads((tmp_path / "k.json").read_text())
        (threads_key,) = [k for k in stored if k.startswith("threads |")]
        assert stored[threads_key]["threads"] == 1 and "4 available" in threads_key
        assert shape_key(select.largest_block_shape(model)) in threads_key
        again = choose_plan(model, tmp_path / "k.json")
        assert (again.threads, again.source, len(timed_counts)) == (1, "cache", 1)  # nothing re-measured
        apply_kernels(model, again)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_largest_block_shape_skips_the_lm_head(tiny_ckpt):
    model = load_model(tiny_ckpt)
    c = model.config
    out_features, in_features = select.largest_block_shape(model)
    assert c.vocab_size not in (out_features, in_features)  # the head is the biggest weight; it is not timed
    assert out_features * in_features == max(c.intermediate_size, c.num_attention_heads * c.head_dim) * c.hidden_size


def _fake_packing_times(monkeypatch, plain: float, kinds: dict[str, tuple[float, float]], run: bool = False):
    """measure_packing's timers faked: the weight's own product takes `plain` seconds, each kind (pack seconds,
    packed product seconds); with `run` each timed function is also called once."""
    monkeypatch.setattr(packed, "available", lambda dtype=torch.float32: list(kinds))
    pack_seconds = iter(pack for pack, _ in kinds.values())
    monkeypatch.setattr(select, "best_time", lambda fn, reps=3: ((fn() if run else None), next(pack_seconds))[1])
    products = {"plain": plain, **{k: product for k, (_, product) in kinds.items()}}
    monkeypatch.setattr(select, "race", lambda fns, reps=3: {name: ((fn() if run else None), products[name])[1]
                                                             for name, fn in fns.items()})


@pytest.mark.parametrize("seconds,steps", [((1.0, 10.0, 0.5), 20), ((1.0, 0.25, 0.9), 3), ((1.0, 10.0, 0.99), 0),
                                           ((1.0, 10.0, 1.2), 0)])
def test_packing_pays_from_pack_time_over_seconds_saved_per_decode_product(seconds, steps, monkeypatch):
    """measure_packing times (the weight's own product, packing, packed product); a gain under PACK_GAIN is noise:
    never. The same rule whichever GEMM the weight's own product runs on."""
    plain, pack, product = seconds
    for backend in ("onednn", "torch"):
        _fake_packing_times(monkeypatch, plain, {"onednn": (pack, product)})
        assert select.measure_packing(48, 32, backend) == ((steps, "onednn") if steps else (0, ""))


@pytest.mark.parametrize("mkl_seconds,chosen", [((4.0, 0.6), (20, "onednn")), ((4.0, 0.2), (5, "mkl")),
                                                ((4.0, 0.5), (20, "onednn"))])
def test_packing_takes_the_kind_with_the_fastest_packed_product(mkl_seconds, chosen, monkeypatch):
    """plain product 1 s; oneDNN packs in 10 s to a 0.5 s product; MKL per mkl_seconds. The faster packed product
    wins (a tie keeps oneDNN, listed first), and its own pack time sets the steps: 10 / 0.5 = 20, 4 / 0.8 = 5."""
    _fake_packing_times(monkeypatch, 1.0, {"onednn": (10.0, 0.5), "mkl": mkl_seconds})
    assert select.measure_packing(48, 32, "torch") == chosen


@pytest.mark.skipif(not onednn.pack_works(), reason="this torch build cannot pack oneDNN weights")
@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_packing_is_timed_against_the_weights_own_gemm(backend, monkeypatch):
    """...in turns with the packed products (one race), the pack itself timed apart."""
    plain_products = []  # (rows, on oneDNN) of each unpacked product timed
    real = onednn.product
    monkeypatch.setattr(onednn, "product", lambda x, w, on_onednn: plain_products.append((x.shape[0], on_onednn))
                        or real(x, w, on_onednn))
    _fake_packing_times(monkeypatch, 1.0, {"onednn": (10.0, 0.5)}, run=True)  # runs each timed function once
    assert select.measure_packing(48, 32, backend) == (20, "onednn")
    assert plain_products == [(select.ROWS[0], backend == "onednn")]


@pytest.mark.parametrize("seconds,in_place", [((1.0, 1.2), True), ((1.0, 1.0), True), ((1.3, 1.0), False)])
@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_weight_gradients_accumulate_in_place_when_that_is_at_least_as_fast(seconds, in_place, backend, monkeypatch):
    """measure_weight_grad times (addmm_ into the gradient, the weight's own GEMM then an add)."""
    timed = iter([seconds])
    monkeypatch.setattr(select, "race", lambda fns, reps=3: dict(zip(fns, next(timed))))
    assert select.measure_weight_grad(1024, 512, backend) == ("inplace" if in_place else backend)
    assert select.measure_weight_grad(48, 32, "torch") == "torch"  # small: autograd's path, nothing timed


def test_plans_written_before_weight_gradients_were_planned_accumulate_through_autograd():
    """...and run their input gradients on the forward's GEMM, as they did when they were recorded."""
    older = {"cpu": "c", "torch": "t", "threads": 2, "gemm": {"48x32": "onednn"}, "decode_packing": {"48x32": 9}}
    plan = KernelPlan.from_json(json.dumps(older), "checkpoint")
    assert plan.weight_grad == {} and not plan.grad_in_place((48, 32)) and plan.decode_packing == {"48x32": 9}
    assert plan.pack_kinds == {} and plan.pack_kind((48, 32)) == "onednn"  # packed as then: by oneDNN
    assert plan.grad_input == {} and plan.grad_input_backend((48, 32)) == "onednn"
    assert plan.grad_input_backend((32, 48)) == "torch"  # a shape the plan does not hold: torch, as its forward
    assert KernelPlan.from_json(plan.to_json(), "checkpoint") == plan


@pytest.mark.parametrize("seconds,choice", [((1.0, 0.5), "onednn"), ((1.0, 0.99), "torch"), ((0.5, 1.0), "torch")])
def test_input_gradient_gemm_is_measured_on_the_transposed_weight(seconds, choice, monkeypatch):
    """measure_grad_input times grad_y [ROWS[1], out] @ W on torch's GEMM, then on oneDNN (given W transposed), and
    keeps oneDNN only where it is ONEDNN_GAIN faster; small torch weights keep autograd's path, untimed."""
    products = []
    real = onednn.product
    monkeypatch.setattr(onednn, "product", lambda a, w, on: products.append((tuple(a.shape), tuple(w.shape), on))
                        or real(a, w, on))
    timed = iter([seconds])
    monkeypatch.setattr(select, "race", lambda fns, reps=3: {name: (fn(), t)[1] for (name, fn), t  # runs each once,
                                                             in zip(fns.items(), next(timed))})  # fakes its time
    big = onednn.MIN_WEIGHT_NUMEL // 512  # out x in = the smallest weight that is timed
    assert select.measure_grad_input(big, 512, "onednn") == choice
    rows = select.ROWS[1]
    assert products == [((rows, big), (512, big), False), ((rows, big), (512, big), True)]
    products.clear()
    assert select.measure_grad_input(48, 32, "torch") == "torch" and products == []


def _cpuinfo(model: int, flags: str) -> str:
    block = (f"processor\t: {{n}}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n"
             f"model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu sse2 {flags}\n")
    return block.format(n=0) + "\n" + block.format(n=1).replace("AMD EPYC", "another name")


def test_cpu_identity_tells_apart_parts_that_share_a_model_name():
    """A plan measured on one part must not be read back on another that a VM also calls "AMD EPYC"."""
    zen3 = describe_cpu(_cpuinfo(1, "fma avx2"))
    zen4 = describe_cpu(_cpuinfo(17, "fma avx2 avx512f avx512_bf16"))
    assert zen3 == "AMD EPYC (cpu family 25, model 1, stepping 1; avx2)"  # the first processor's fields
    assert zen4 == "AMD EPYC (cpu family 25, model 17, stepping 1; avx2 avx512f avx512_bf16)"
    assert describe_cpu("model name\t: Some CPU\n") == "Some CPU"  # nothing else known: the name alone


@pytest.mark.parametrize("load, cached", [(1.2, True), (1.6, False), (3.0, False)])
def test_a_thread_count_timed_beside_other_work_is_not_cached(load, cached, tiny_ckpt, tmp_path, monkeypatch):
    """Timed while other work held a core, two threads looked slower than one (each waits on the busy core): that
    run uses what it measured, but the next run measures again instead of inheriting it."""
    from grpo_engine.kernels import threads

    model = load_model(tiny_ckpt)
    monkeypatch.delenv("GRPO_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "AVAILABLE", 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(threads, "measure", lambda counts, fn: {1: 1.0, 2: 1.5})
    cache = {}
    assert select.choose_threads(model, cache) == 1
    assert any(k.startswith("threads |") for k in cache) == cached


def test_race_times_the_candidates_in_turns_and_keeps_each_ones_fastest_call(monkeypatch):
    """A burst of other work (here: the first timed round, 10 s per call) slows one round of each candidate, not
    every call of one, so the faster candidate still wins; each is warmed up once, untimed."""
    clock, calls = [0.0], []
    seconds = {"a": iter([99.0, 10.0, 1.0, 3.0]), "b": iter([99.0, 10.0, 2.0, 2.0])}  # warm-up first

    def run(name):
        calls.append(name)
        clock[0] += next(seconds[name])

    monkeypatch.setattr(select.time, "perf_counter", lambda: clock[0])
    assert select.race({"a": lambda: run("a"), "b": lambda: run("b")}, reps=3) == {"a": 1.0, "b": 2.0}
    assert calls == ["a", "b"] * 4
