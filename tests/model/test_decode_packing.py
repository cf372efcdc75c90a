"""kernels/packing.py, kernels/packed.py: weights packed once per decode loop (by oneDNN or MKL), only where the plan
says it pays, only trainable ones, repacked or dropped as the batch shrinks, never left behind -- and the same
numbers as the plain products."""

import pytest
import torch

from grpo_engine.kernels import KernelPlan, apply_kernels, onednn, packed, select
from grpo_engine.kernels.select import packing_key, shape_key, weight_shapes
from grpo_engine.model.loading import load_model
from grpo_engine.rollout import SamplingParams, generate

pytestmark = pytest.mark.skipif(not onednn.pack_works(), reason="this torch build cannot pack oneDNN weights")


KINDS = [pytest.param(k, marks=pytest.mark.skipif(not packed.works(k), reason=f"{k} cannot pack here"))
         for k in packed.KINDS]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,shape", [(1, (301, 24)), (32, (64, 48)), (7, (48, 64))])
def test_packed_products_match_float64(rows, shape, kind):
    """Packed for 32 rows, right for any row count (MKL's other counts run on the plain weight)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, shape[1], generator=g), torch.randn(shape, generator=g)
    bias = torch.randn(shape[0], generator=g)
    p = packed.pack(w, 32, kind)
    ref = x.double() @ w.double().t()  # [rows, out]
    torch.testing.assert_close(p(x).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p(x, bias).double(), ref + bias.double(), rtol=1e-5, atol=1e-5)


def _planned_model(path, packing_after: int, gemm: str = "onednn", kind: str = "onednn"):
    """The tiny model with every weight on `gemm` and every shape packed by `kind` from `packing_after` steps."""
    model = load_model(path)
    shapes = [shape_key(s) for s in weight_shapes(model)]
    plan = KernelPlan("cpu", torch.__version__, 1, dict.fromkeys(shapes, gemm),
                      decode_packing=dict.fromkeys(shapes, packing_after), pack_kinds=dict.fromkeys(shapes, kind))
    return apply_kernels(model, plan)


def _generate(model, new: int, stop_token_ids=()):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=new, stop_token_ids=list(stop_token_ids))
    return generate(model, [[1, 5, 9, 2], [3, 4]], params, seed=11)


def _record_packs(monkeypatch) -> list[tuple[int, ...]]:
    packed_shapes = []
    real_pack = onednn.pack
    monkeypatch.setattr(onednn, "pack", lambda w, rows: packed_shapes.append(tuple(w.shape)) or real_pack(w, rows))
    return packed_shapes


@pytest.mark.parametrize("gemm", ["onednn", "torch"])  # packing is planned whichever GEMM trains the weight
def test_long_enough_loops_pack_every_trainable_weight_once_and_unpack_after(tiny_ckpt, monkeypatch, gemm):
    model = _planned_model(tiny_ckpt, packing_after=5, gemm=gemm)
    packed_shapes = _record_packs(monkeypatch)
    _generate(model, new=4)  # shorter than the plan's 5 steps: nothing packed
    assert packed_shapes == []
    _generate(model, new=6)
    projections = [m for m in model.modules() if isinstance(m, onednn.OneDNNLinear)]
    assert len(packed_shapes) == len(projections) + 1  # every block projection, then the LM head
    assert packed_shapes[-1] == tuple(model.lm_head.weight.shape)
    assert all(m.packed is None for m in projections)  # nothing outlives the loop


def test_frozen_weights_are_never_packed(tiny_ckpt, monkeypatch):
    model = _planned_model(tiny_ckpt, packing_after=1)
    frozen = model.layers[0].mlp.up_proj
    frozen.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    packed_shapes = _record_packs(monkeypatch)
    _generate(model, new=3)
    trainable = [m for m in model.modules() if isinstance(m, onednn.OneDNNLinear) and m.weight.requires_grad]
    assert len(packed_shapes) == len(trainable)  # neither the frozen projection nor the frozen head


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gemm", ["onednn", "torch"])
def test_packed_decoding_samples_what_the_plain_weights_sample(tiny_ckpt, gemm, kind):
    """Also while rows finish and leave the batch (stop ids common enough that most rows stop early): MKL's
    weights are repacked for each smaller batch, or dropped near the end."""
    stops = range(0, 256, 9)
    for stop_ids in ((), stops):
        out = _generate(_planned_model(tiny_ckpt, packing_after=2, gemm=gemm, kind=kind), 12, stop_ids)
        plain = _generate(_planned_model(tiny_ckpt, packing_after=0, gemm=gemm), 12, stop_ids)  # 0: never packed
        assert out.completion_ids == plain.completion_ids
        for a, b in zip(out.logprobs, plain.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    assert len({len(c) for c in out.completion_ids}) > 1  # rows did stop at different steps


@pytest.mark.parametrize("kind", KINDS)
def test_a_shrinking_batch_repacks_mkl_weights_while_it_pays_and_drops_them_after(tiny_ckpt, kind):
    """Packing pays from 5 steps here. MKL's packs are for one row count: 6 -> 4 rows with 10 steps left repacks
    them for 4; 4 -> 3 rows with 2 steps left drops them (the plan's GEMM runs the rest). oneDNN's packs serve any
    row count and stay as they are."""
    model = _planned_model(tiny_ckpt, packing_after=5, kind=kind)
    projections = [m for m in model.modules() if isinstance(m, onednn.OneDNNLinear)]
    packs = model.kernels.decode.pack(model, 6, 20)  # what apply_kernels set for the decode loops
    first = [m.packed for m in projections]
    assert all(p.kind == kind and p.rows == 6 for p in first) and packs.head.rows == 6
    packs.resize(4, 10)
    if kind == "mkl":
        assert all(m.packed.rows == 4 for m in projections) and packs.head.rows == 4
    else:
        assert [m.packed for m in projections] == first and packs.head.rows == 6
    packs.resize(3, 2)
    assert all((m.packed is None) == (kind == "mkl") for m in projections) and (packs.head is None) == (kind == "mkl")
    packs.release()
    assert all(m.packed is None for m in projections) and packs.head is None


def test_packed_weights_are_not_used_with_gradients_on(tiny_ckpt):
    """A projection holding a packed weight still trains through its Parameter (autograd path)."""
    model = _planned_model(tiny_ckpt, packing_after=1)
    layer = model.layers[0].mlp.up_proj
    layer.packed = packed.pack(torch.zeros_like(layer.weight), 8, "onednn")  # a stale packing: must be ignored
    x = torch.randn(2, 3, layer.in_features)
    y = layer(x)
    torch.testing.assert_close(y, x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert layer.weight.grad is not None
    with torch.no_grad():
        assert torch.count_nonzero(layer(x)) == 0  # without gradients the packed weight is what runs
    layer.packed = None


BF16 = pytest.mark.skipif(not packed.works("onednn", torch.bfloat16), reason="oneDNN cannot pack bf16 weights here")


@BF16
def test_only_onednn_packs_bf16_weights_and_its_products_match_torchs():
    """MKL's packed GEMM is fp32 only. oneDNN's packed bf16 product against torch's bf16 GEMM: both sum in fp32
    and round once to bf16, so they differ by at most one bf16 step of the result."""
    assert packed.available(torch.bfloat16) == ["onednn"] and not packed.works("mkl", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 576, generator=g).bfloat16(), torch.randn(200, 576, generator=g).bfloat16()
    p = packed.pack(w, 32, "onednn")
    got, want = p(x), x @ w.t()  # [32, 200]
    assert got.dtype == torch.bfloat16
    exact = x.double() @ w.double().t()
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)  # one bf16 rounding of the fp32 sum
    assert (got.double() - want.double()).abs().max() <= want.double().abs().max() * 2**-7


def test_packing_keys_name_the_dtype_except_fp32():
    assert packing_key((1536, 576)) == shape_key((1536, 576)) == "1536x576"
    assert packing_key((1536, 576), torch.bfloat16) == "1536x576 bfloat16"


@BF16
def test_a_bf16_model_packs_its_trainable_weights_by_the_plans_bf16_entries(tiny_ckpt, monkeypatch):
    """The plan's bf16 entries (and not its fp32 ones) pack a bf16 model's weights; the tokens sampled match."""
    model = load_model(tiny_ckpt, dtype=torch.bfloat16)
    shapes = weight_shapes(model, torch.bfloat16)
    assert weight_shapes(model) == [] and shapes
    fp32_only = KernelPlan("cpu", torch.__version__, 1, {}, decode_packing=dict.fromkeys(map(shape_key, shapes), 1))
    bf16_keys = [packing_key(s, torch.bfloat16) for s in shapes]
    planned = KernelPlan("cpu", torch.__version__, 1, {}, decode_packing=dict.fromkeys(bf16_keys, 1))
    packed_shapes = _record_packs(monkeypatch)
    outs = []
    for plan in (fp32_only, planned):
        apply_kernels(model, plan)
        outs.append(_generate(model, new=8))
    projections = [m for m in model.modules() if isinstance(m, onednn.OneDNNLinear)]
    assert len(packed_shapes) == len(projections) + 1  # only under the bf16 entries: every projection and the head
    assert outs[0].completion_ids == outs[1].completion_ids
    for a, b in zip(outs[0].logprobs, outs[1].logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=0.05)  # bf16 logits


@BF16
def test_the_plan_measures_bf16_packing_against_torchs_bf16_gemm(tiny_ckpt, tmp_path, monkeypatch):
    for name in ("GRPO_KERNELS", "GRPO_ONEDNN"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(select, "measure_packing", lambda *a: calls.append(a) or (3, "onednn"))
    model = load_model(tiny_ckpt, dtype=torch.bfloat16)
    plan = select.choose_plan(model, tmp_path / "kernels.json")
    shapes = weight_shapes(model, torch.bfloat16)
    assert sorted(calls) == sorted((*s, "torch", torch.bfloat16) for s in shapes)
    assert plan.decode_packing == {packing_key(s, torch.bfloat16): 3 for s in shapes}
    assert all(plan.pack_kind(s, torch.bfloat16) == "onednn" for s in shapes)
    calls.clear()
    assert select.choose_plan(model, tmp_path / "kernels.json").decode_packing == plan.decode_packing and not calls
