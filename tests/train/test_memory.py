"""Memory knobs: checkpointing is exact, precision casts, peak readers measure real allocations."""

import mmap
import warnings
from dataclasses import replace

import pytest
import torch
from references import rss_mib

from grpo_engine.kernels import checkpointed_blocks
from grpo_engine.model.lora import LoRAConfig, apply_lora
from grpo_engine.model.tiny import init_weights, tiny_config
from grpo_engine.model.transformer import Transformer
from grpo_engine.train.memory import (
    MemorySection,
    apply_memory_config,
    free_rollout_memory,
    peak_memory_mib,
    reset_peak_memory,
)


def tiny_model(layers=4):
    model = Transformer(tiny_config("qwen2", num_hidden_layers=layers))
    init_weights(model, seed=0)
    return model.train()


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids)  # [B, T, V]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode,k,want_every", [("all", 2, 1), ("every_k", 2, 2), ("every_k", 3, 3)])
def test_checkpointing_gives_identical_loss_and_grads(mode, k, want_every):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model = tiny_model()
    ref_loss, ref_grads = loss_and_grads(model, ids)
    cfg = MemorySection(precision="fp32", activation_checkpointing=mode, checkpoint_every=k)
    apply_memory_config(model, cfg)
    assert checkpointed_blocks(model) == [i for i in range(len(model.layers)) if i % want_every == 0]
    loss, grads = loss_and_grads(model, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7)


def test_checkpointing_with_lora_grads_match():
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    model = apply_lora(tiny_model(), LoRAConfig(rank=4))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    _, ref = loss_and_grads(model, ids)
    apply_memory_config(model, MemorySection(precision="fp32", activation_checkpointing="all"))
    _, got = loss_and_grads(model, ids)
    assert sorted(got) == sorted(ref) and all("lora_" in n for n in got)
    for n in got:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7)


def test_precision_casts_base_but_not_adapters():
    model = apply_lora(tiny_model(), LoRAConfig(rank=4))
    apply_memory_config(model, MemorySection(precision="bf16", activation_checkpointing="none"))
    assert model.layers[0].attn.q_proj.weight.dtype == torch.bfloat16
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.layers[0].attn.q_proj.lora_A.dtype == torch.float32
    assert checkpointed_blocks(model) == []


def test_bad_memory_config():
    with pytest.raises(ValueError, match="activation_checkpointing"):
        MemorySection(activation_checkpointing="some")
    with pytest.raises(ValueError, match="precision"):
        MemorySection(precision="fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU RSS reader")
def test_cpu_peak_reader_sees_a_64mib_allocation():
    free_rollout_memory()
    if not reset_peak_memory("cpu"):
        pytest.skip("peak RSS is not resettable on this OS")
    before = peak_memory_mib("cpu")
    # Fresh pages from the kernel (an anonymous mapping), touched: malloc could instead hand back memory that
    # earlier tests freed and that is still resident, which would not raise the RSS at all.
    x = mmap.mmap(-1, 64 * 1024 * 1024)
    for page in range(0, len(x), 4096):  # touch every page (one byte each: no 64 MiB temporary)
        x[page] = 1
    during = rss_mib()
    x.close()
    peak = peak_memory_mib("cpu")
    assert 60 <= peak - before <= 80, (before, peak)
    assert during - before >= 60


# a fresh process's glibc and its mallinfo2 (glibc >= 2.33): `mapped()` = bytes it serves by mmap
MALLINFO = """
import ctypes, torch
from grpo_engine.train.memory import GLIBC_MMAP_MAX, M_MMAP_THRESHOLD, update_allocations
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
mapped = lambda: libc.mallinfo2().hblkhd
"""


def _run_mallinfo_probe(probe: str) -> str:
    """The stdout of `probe` run in a fresh Python process (skipped without glibc >= 2.33's mallinfo2)."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc" or not hasattr(__import__("ctypes").CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallopt, mallinfo2)")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          check=True).stdout

MMAP_PROBE = MALLINFO + """
size = 4 * 1024 * 1024
with update_allocations("mmap"):
    before = mapped(); inside = torch.empty(size, dtype=torch.uint8); grown = mapped() - before
    del inside; shrunk = mapped() - before
before = mapped(); outside = torch.empty(size, dtype=torch.uint8); grown_after = mapped() - before
print(grown, shrunk, grown_after, size)
"""


def test_update_allocations_are_mmapped_inside_the_block_only():
    """memory.cpu_update_mmap: in a fresh process (glibc serves a request from free heap chunks first, whatever
    the threshold), a 4 MiB tensor made inside the block is an mmapped chunk, unmapped when freed; after the
    block the threshold is glibc's 32 MiB maximum, so the same request comes from the heap."""
    out = _run_mallinfo_probe(MMAP_PROBE)
    grown, shrunk, grown_after, size = map(int, out.split())
    assert grown >= size and abs(shrunk) < size, (grown, shrunk)
    assert grown_after < size, grown_after


HEAP_PROBE = MALLINFO + """
libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_MAX)  # as after an earlier update
with update_allocations("trim"):
    before = mapped(); inside = torch.empty(4 * 1024 * 1024, dtype=torch.uint8)
    print(mapped() - before)
"""


def test_trim_keeps_the_updates_allocations_on_the_heap():
    """memory.cpu_update_mmap=trim sets no mmap threshold: with glibc's threshold at its 32 MiB maximum (as after
    an earlier update), a 4 MiB tensor made inside the block comes from the heap, not from mmap."""
    out = _run_mallinfo_probe(HEAP_PROBE)
    assert int(out.split()[-1]) < 4 * 1024 * 1024, out


TRIM_PROBE = """
import ctypes, os, sys, torch
from grpo_engine.train.memory import GLIBC_MMAP_MAX, M_MMAP_THRESHOLD, update_allocations
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_MAX)  # as after an update: a few MB come from the heap
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
held = [torch.ones(2 * 1024 * 1024, dtype=torch.uint8) for _ in range(40)]  # 80 MiB of heap, touched
pin = torch.ones(2 * 1024 * 1024, dtype=torch.uint8)  # above them: the heap top cannot shrink on its own
del held
before = rss()
with update_allocations(sys.argv[1]):
    inside = rss()
print(before - inside)
"""


@pytest.mark.parametrize("rule, releases", [("mmap", True), ("trim", True), ("heap", False)])
def test_update_block_releases_the_freed_heap_pages_of_the_rollout(rule, releases):
    """memory.cpu_update_mmap true or trim: the heap chunks the rollout freed (decode's packed weights) are given
    back to the OS when the update starts, instead of staying resident under the update's own allocations; the
    heap rule (auto, false) leaves them."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("needs glibc (mallopt, malloc_trim)")
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE, rule], capture_output=True, text=True, timeout=120,
                         check=True)
    released = int(out.stdout.split()[-1])
    assert (released >= 60 * 1024 * 1024) == releases, released


def test_step_frees_the_gradients_before_the_next_rollout(tiny_ckpt, monkeypatch):
    """After a GRPO step (which did update the weights) no parameter holds a gradient: the rollout that follows
    does not carry a copy of the weights' size."""
    import grpo_engine.train.step as step_mod
    from grpo_engine.bench.step import bench_step

    seen, real = [], step_mod.grpo_step

    def step(inputs, state, n, message=print):
        record = real(inputs, state, n, message)
        seen.append((record.update.grad_norm, [p.grad for p in inputs.policy.model.parameters()]))
        return record

    monkeypatch.setattr(step_mod, "grpo_step", step)
    bench_step(str(tiny_ckpt), prompts=2, group=3, max_new=5, prompt_len=24, steps=1)
    (grad_norm, grads), = seen
    assert grad_norm > 0
    assert all(g is None for g in grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_reader():
    reset_peak_memory("cuda")
    base = peak_memory_mib("cuda")
    x = torch.ones(16 * 1024 * 1024, device="cuda")
    del x
    assert 63 <= peak_memory_mib("cuda") - base <= 65


@pytest.mark.parametrize("micro_batch_tokens", [1024, 400_000])
def test_auto_checkpointing_resolved_by_the_trainer(tiny_ckpt, tmp_path, micro_batch_tokens):
    """build_policy applies what the planner's rule says for this model and micro-batch (not a fixed choice):
    the tiny model's 1,024-token activations are far under 256 MiB (none); 400k tokens are over it and over
    1/4 of its state (all)."""
    from pathlib import Path

    from grpo_engine.config import load_config
    from grpo_engine.plan.from_config import plan_input_from_config
    from grpo_engine.plan.memory import resolve_checkpointing
    from grpo_engine.plan.resolved import resolve_settings
    from grpo_engine.train.policy import build_policy

    cfg = load_config(str(Path(__file__).parents[2] / "configs/tiny_arithmetic.yaml"),
                      [f"model.path={tiny_ckpt}", f"run_dir={tmp_path}", "memory.precision=fp32",
                       f"memory.micro_batch_tokens={micro_batch_tokens}"])
    assert cfg.memory.activation_checkpointing == "auto"  # the default
    policy = build_policy(resolve_settings(cfg, torch.device("cpu")))
    knobs = plan_input_from_config(cfg)
    want = resolve_checkpointing(policy.model.config, replace(knobs, precision="fp32"), micro_batch_tokens)
    assert want == ("none" if micro_batch_tokens == 1024 else "all")
    n = len(policy.model.layers)
    assert checkpointed_blocks(policy.model) == (list(range(n)) if want == "all" else [])


def test_unresolved_auto_is_refused():
    with pytest.raises(ValueError, match="resolved"):
        apply_memory_config(tiny_model(), MemorySection(precision="fp32", activation_checkpointing="auto"))


def test_build_policy_asks_about_bf16_only_for_bf16_on_the_cpu(monkeypatch, tiny_ckpt, tmp_path):
    from grpo_engine.config import load_config
    from grpo_engine.plan.resolved import resolve_settings
    from grpo_engine.train import policy as policy_mod

    asked = []
    monkeypatch.setattr(policy_mod, "warn_if_bf16_is_slow", lambda config: asked.append(config.hidden_size))
    for precision in ("bf16", "fp32"):
        cfg = load_config(None, [f"model.path={tiny_ckpt}", f"run_dir={tmp_path}", f"memory.precision={precision}"])
        policy_mod.build_policy(resolve_settings(cfg, torch.device("cpu")))
    assert asked == [policy_mod.load_model(tiny_ckpt).config.hidden_size]  # once, for the bf16 run


def test_bf16_on_a_cpu_without_native_bf16_is_named(monkeypatch):
    """memory.precision=bf16 on a CPU whose bf16 products are slower than fp32 (no AVX512_BF16 / AMX: a step many
    times as long) is said up front, with the fix; where bf16 is fast nothing is said."""
    from grpo_engine.kernels import select
    from grpo_engine.train import policy as policy_mod

    products = []  # what the bf16 side of bf16_ratio times: the bf16 product a bf16 nn.Linear runs
    monkeypatch.setattr(select, "best_time", lambda fn, reps=3: (products.append(fn()), 2.0)[1])
    assert select.measure_bf16_shape(128, 64) == 2.0 * len(select.ROWS)  # summed over the row counts
    assert [(p.dtype, tuple(p.shape)) for p in products] == [(torch.bfloat16, (m, 128)) for m in select.ROWS]
    config = tiny_config()
    monkeypatch.setattr(policy_mod, "bf16_ratio", lambda hidden, inter: 4.0)
    with pytest.warns(UserWarning, match=r"4\.0x as long as in fp32.*memory.precision=fp32"):
        policy_mod.warn_if_bf16_is_slow(config)
    monkeypatch.setattr(policy_mod, "bf16_ratio", lambda hidden, inter: 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy_mod.warn_if_bf16_is_slow(config)


@pytest.mark.parametrize("setting, device, expected", [
    ("auto", "cpu", "heap"),  # page faults cost too much update time on some hosts to be a default
    ("true", "cpu", "mmap"),
    ("false", "cpu", "heap"),
    ("trim", "cpu", "trim"),
    ("true", "meta", "heap"),  # a CPU allocator setting: never on another device
    ("trim", "meta", "heap"),
])
def test_update_allocations_follow_the_setting(setting, device, expected):
    from grpo_engine.train.memory import update_allocations_rule

    assert update_allocations_rule(setting, torch.device(device)) == expected


def test_update_mmap_setting_takes_yaml_booleans(tmp_path):
    """Configs written before "auto" existed say `cpu_update_mmap: true` (the real-model recipe does)."""
    from grpo_engine.config import load_config

    yaml = tmp_path / "c.yaml"
    yaml.write_text("memory:\n  cpu_update_mmap: true\n")
    assert load_config(str(yaml)).memory.cpu_update_mmap == "true"
    assert load_config(None, ["memory.cpu_update_mmap=false"]).memory.cpu_update_mmap == "false"
    assert load_config(None).memory.cpu_update_mmap == "auto"
    with pytest.raises(ValueError, match="memory.cpu_update_mmap='often' is not one of auto, true, false"):
        load_config(None, ["memory.cpu_update_mmap=often"])
