"""benchmarks/step_breakdown.py: a step's matrix products against its matmul floor, phase by phase."""

from types import SimpleNamespace

import pytest
from benchmark_scripts import load_benchmark


def _breakdown():
    return load_benchmark("step_breakdown")


def test_phase_seconds_sum_the_self_time_of_the_product_ops():
    """Products and all ops by their self time; the optimizer by its whole time (its own ops are counted there)."""
    bench = _breakdown()
    events = [("aten::mm", 3_000_000, 3_000_000), ("mkl::_mkl_linear", 500_000, 500_000),
              ("aten::silu", 250_000, 250_000), ("aten::_scaled_dot_product_flash_attention_for_cpu", 1e6, 1e6),
              ("aten::linear", 50_000, 3_550_000), ("Optimizer.step#OffloadedAdamW.step", 40_000, 300_000),
              ("aten::_fused_adamw_", 260_000, 260_000)]
    prof = SimpleNamespace(key_averages=lambda: [SimpleNamespace(key=k, self_cpu_time_total=s, cpu_time_total=t)
                                                 for k, s, t in events])
    assert bench.phase_seconds(prof) == pytest.approx((4.5, 5.1, 0.3))  # microseconds -> seconds


def test_report_sets_each_phase_against_its_own_floor():
    bench = _breakdown()
    results = {"generate": {"wall_s": 6.0, "products_s": 4.0, "ops_s": 5.5},
               "update": {"wall_s": 15.0, "products_s": 12.0, "ops_s": 14.0, "optimizer_s": 1.0}}
    gflop = {"generate": 400.0, "logprobs": 0.0, "update": 2000.0}  # floor: 2,400 GFLOP / 200 GFLOP/s = 12 s
    r = bench.report(results, gflop, 200.0, times=[30.0, 24.0, 99.0], cpu="cpu")
    gen, upd = r["phases"]["generate"], r["phases"]["update"]
    assert (gen["floor_s"], gen["products_gflops"], gen["wall_over_floor"], gen["products_over_floor"]) == \
        pytest.approx((2.0, 100.0, 3.0, 2.0))
    assert (upd["floor_s"], upd["products_gflops"], upd["wall_over_floor"], upd["products_over_floor"]) == \
        pytest.approx((10.0, 2000 / 12, 1.5, 1.2))
    assert upd["bound_over_floor"] == pytest.approx(1.3)  # (12 s of products + 1 s of optimizer) / 10 s
    # the profiled (last) step's time holds the profiler's processing: the step before it is the step's time
    assert (r["step_s"], r["step_over_floor"], r["products_s"], r["products_over_floor"]) == \
        pytest.approx((24.0, 2.0, 16.0, 16 / 12))


def test_a_phase_wall_time_is_the_unprofiled_one_of_the_step_before(monkeypatch):
    """Under a fake clock each call of the phase takes 3 s without the profiler and 5 s under it: wall_s is the
    3 s of the step before, profiled_wall_s the 5 s of the profiled step; the module's phase is restored."""
    bench = _breakdown()
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    state = {}

    def phase():
        clock[0] += 5.0 if state["profiles"].on else 3.0

    module = SimpleNamespace(update_step=phase)
    with bench.PhaseProfiles(module, {"update_step": "update"}) as state["profiles"]:
        module.update_step()
        state["profiles"].on = True
        module.update_step()
    r = state["profiles"].results["update"]
    assert (r["wall_s"], r["profiled_wall_s"]) == (3.0, 5.0)
    assert module.update_step is phase


def test_breakdown_profiles_a_real_step_and_leaves_the_trainer_as_it_was(tiny_ckpt):
    import grpo_engine.train.step as step_module

    bench = _breakdown()
    before = (step_module.collect_groups, step_module.update_step, step_module.attach_logprobs)
    args = SimpleNamespace(model=str(tiny_ckpt), prompts=2, group=3, max_new=5, prompt_len=24, steps=2, overrides=[],
                           precision="fp32")
    r = bench.measure(args)
    assert r["precision"] == "fp32"
    assert set(r["phases"]) == {"generate", "update"}  # beta 0, mu 1: no log-prob pass
    for phase in r["phases"].values():
        assert 0 < phase["products_s"] < phase["ops_s"] <= phase["profiled_wall_s"] and phase["wall_s"] > 0
    # torch.optim's record of the optimizer step is found in the update's profile, and only there
    assert 0 < r["phases"]["update"]["optimizer_s"] < r["phases"]["update"]["profiled_wall_s"]
    assert r["phases"]["generate"]["optimizer_s"] == 0
    assert (step_module.collect_groups, step_module.update_step, step_module.attach_logprobs) == before


def test_bf16_breakdown_runs_the_step_in_bf16_against_the_bf16_rate(tiny_ckpt, monkeypatch):
    """--precision bf16: the step's weights are bf16, every GEMM reading is a bf16 one, and each phase's floor is its
    matmul FLOPs over that rate (100 GFLOP/s here), not the fp32 one (400)."""
    import grpo_engine.bench.floor as floor
    from grpo_engine.model.loading import load_model

    asked = []

    def rates(reps=5, precision="fp32"):
        asked.append(precision)
        return {"torch": 100.0} if precision == "bf16" else {"torch": 400.0, "onednn": 350.0}

    monkeypatch.setattr(floor, "gemm_rates", rates)
    bench = _breakdown()
    args = SimpleNamespace(model=str(tiny_ckpt), prompts=2, group=3, max_new=5, prompt_len=24, steps=2, overrides=[],
                           precision="bf16")
    r = bench.measure(args)
    assert (r["precision"], r["gemm_gflops"]) == ("bf16", 100.0)  # precision read back from the weights' dtype
    assert asked == ["bf16"] * 3  # before each of the last two steps and after the last
    flops = floor.step_flops(load_model(tiny_ckpt).config, floor.StepSizes(2, 3, 24, 5))  # beta 0, mu 1, no recompute
    assert r["phases"]["generate"]["floor_s"] == pytest.approx(flops.generate / 1e9 / 100.0)
    assert r["phases"]["update"]["floor_s"] == pytest.approx(flops.update / 1e9 / 100.0)
    assert r["floor_s"] == pytest.approx(flops.total / 1e9 / 100.0)


def test_precision_is_set_by_the_flag_not_an_override(monkeypatch, capsys):
    bench = _breakdown()
    monkeypatch.setattr("sys.argv", ["step_breakdown.py", "--model", "m", "memory.precision=bf16"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--precision fp32|bf16, not a memory.precision= override" in capsys.readouterr().err
