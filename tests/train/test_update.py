"""The update phase: micro-batched gradients through rl.policy_loss equal the one-big-batch gradients."""

import itertools

import pytest
import torch

from grpo_engine.config import algorithm as A
from grpo_engine.model.loading import load_model
from grpo_engine.rl.losses import LossConfig, ResolvedLoss, is_tokenwise, resolve
from grpo_engine.train.batch import build_train_batch, micro_batches
from grpo_engine.train.forward import batch_logprobs
from grpo_engine.train.update import accumulate_gradients, combine_metrics


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    prompt_lens, comp_lens = [3, 5, 4, 2, 6, 3], [7, 2, 5, 9, 4, 1]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    comps = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in comp_lens]
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5, 0.75, 0.0])
    keep = [True, True, True, True, True, False]  # the last row is masked out (e.g. truncated)
    return build_train_batch(prompts, comps, [[0.0] * n for n in comp_lens], adv, keep, pad_id=0)


def _grads(model, batch, cfg, budget):
    model.zero_grad(set_to_none=True)
    stats = accumulate_gradients(model, batch, cfg, budget, temperature=1.0, chunk_size=4)
    return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_micro_batching_is_exact(tiny_ckpt, preset):
    model = load_model(tiny_ckpt)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():  # an "old" policy a little away from the current one, so ratios != 1
        old = batch_logprobs(model, batch, 10_000, temperature=1.0, chunk_size=4)
        ref = old - 0.05
    noise = 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))  # [B, T]
    batch.old_logp, batch.ref_logp = (old + noise) * batch.completion_mask, ref
    cfg = resolve(LossConfig(loss=preset, beta=0.04, entropy_coef=0.01, max_completion_len=9))
    assert len(micro_batches(batch.lengths.tolist(), 12)) >= 4  # really split
    whole, g_whole = _grads(model, batch, cfg, 10_000)
    split, g_split = _grads(model, batch, cfg, 12)
    assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    assert split.metrics["active_tokens"] == whole.metrics["active_tokens"] == 27  # 7+2+5+9+4, row 6 masked
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=1e-4, atol=1e-6)


def _old_and_ref(model, batch):
    """Old log-probs a little away from the current policy (ratios != 1, some clipped) and a reference."""
    with torch.no_grad():
        old = batch_logprobs(model, batch, 10_000, temperature=1.0, chunk_size=4)
    noise = 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))  # [B, T]
    return (old + noise) * batch.completion_mask, old - 0.05


def _tokenwise_losses() -> list[ResolvedLoss]:
    """Every per-token loss the config can name: each combination of preset, ratio level, rollout correction,
    correction level and top-entropy masking for which is_tokenwise holds (GSPO with a token ratio; TIS and MIS
    per token), one case per distinct loss. The KL estimators, the entropy bonus and the dual clip are spread
    over the cases, and each correction's cap is one that this test's mismatch reaches."""
    cases, seen = [], set()
    axes = itertools.product(A.LOSSES, A.RATIO_LEVELS, A.ROLLOUT_CORRECTIONS, A.CORRECTION_LEVELS, (1.0, 0.2))
    for loss, ratio, correction, level, top_q in axes:
        cfg = resolve(LossConfig(loss=loss, ratio_level=ratio, rollout_correction=correction,
                                 rollout_correction_level=level, entropy_top_quantile=top_q, max_completion_len=9))
        key = (loss, ratio, correction, level if correction != "none" else "-")
        if not is_tokenwise(cfg) or key in seen:
            continue
        seen.add(key)
        i = len(cases)
        cases.append(resolve(LossConfig(
            loss=loss, ratio_level=ratio, rollout_correction=correction, rollout_correction_level=level,
            rollout_correction_cap=1.3, max_completion_len=9, beta=0.04 if i % 2 == 0 else 0.0,
            kl_estimator=A.KL_ESTIMATORS[i % 3], entropy_coef=0.01 if i % 3 != 1 else 0.0,
            dual_clip_c=3.0 if i % 4 == 1 else None)))
    return cases


TOKENWISE_LOSSES = _tokenwise_losses()


def test_the_tokenwise_losses_cover_every_preset_and_token_correction():
    """18 losses: the six presets (GSPO only with a token ratio) x no / TIS / MIS correction per token."""
    assert len(TOKENWISE_LOSSES) == 18
    assert {c.loss for c in TOKENWISE_LOSSES} == set(A.LOSSES)
    assert {(c.loss, c.rollout_correction) for c in TOKENWISE_LOSSES} == set(
        itertools.product(A.LOSSES, A.ROLLOUT_CORRECTIONS))
    assert {c.kl_estimator for c in TOKENWISE_LOSSES if c.beta > 0} == set(A.KL_ESTIMATORS)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-tied"])
@pytest.mark.parametrize("cfg", TOKENWISE_LOSSES,
                         ids=[f"{c.loss}-{c.rollout_correction}-{c.kl_estimator if c.beta else 'nokl'}"
                              for c in TOKENWISE_LOSSES])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_gradients_equal_autograd_float64(tiny_ckpt_factory, arch, cfg, temperature):
    """The head's in-forward gradients == autograd through policy_loss, for every loss is_tokenwise admits."""
    model = load_model(tiny_ckpt_factory(arch), dtype=torch.float64)
    batch = _batch(model.config.vocab_size)
    batch.old_logp, batch.ref_logp = _old_and_ref(model, batch)
    if cfg.rollout_correction != "none":
        noise = 0.4 * torch.randn(batch.old_logp.shape, generator=torch.Generator().manual_seed(4))  # [B, T]
        batch.sampler_logp = (batch.old_logp + noise) * batch.completion_mask
    grads, stats = {}, {}
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        stats[fused] = accumulate_gradients(model, batch, cfg, 12, temperature=temperature, chunk_size=4,
                                            fused_head=fused)
        grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys()
    if cfg.surrogate == "clip":  # (CISPO's weight cap of 5 is not reached by this noise; SAPO never clips)
        assert stats[True].metrics["clip_frac_low"] + stats[True].metrics["clip_frac_high"] > 0  # clips are live
    if cfg.rollout_correction != "none":
        assert 0 < stats[True].metrics["rollout_correction_frac"] < 1  # the correction is live
    assert stats[True].metrics == pytest.approx(stats[False].metrics, rel=1e-12, abs=1e-12)
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=1e-10)


@pytest.mark.parametrize("cfg,tokenwise", [
    (resolve(LossConfig(loss="grpo")), True),
    (resolve(LossConfig(loss="gspo")), False),  # sequence-level ratio
    (resolve(LossConfig(loss="dapo", ratio_level="sequence")), False),
    (resolve(LossConfig(loss="grpo", entropy_top_quantile=0.2)), False),  # a batch quantile
    (resolve(LossConfig(loss="sapo")), True),
    (resolve(LossConfig(loss="dapo", rollout_correction="tis")), True),  # a token's weight depends on that token only
    (resolve(LossConfig(loss="dapo", rollout_correction="mis", rollout_correction_level="sequence")), False),
])
def test_is_tokenwise(cfg, tokenwise):
    assert is_tokenwise(cfg) is tokenwise


def _grouped_batch(vocab: int, share: bool):
    """3 prompts x 3 samples, mixed prompt and completion lengths, one masked row."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 2, 6)]
    comp_lens = [5, 1, 3, 7, 2, 2, 4, 6, 1]
    comps = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in comp_lens]
    adv = torch.linspace(-1.0, 1.0, 9)
    keep = [True] * 8 + [False]
    return build_train_batch([prompts[i // 3] for i in range(9)], comps, [[0.0] * n for n in comp_lens], adv,
                               keep, pad_id=0, share_prompts=share)


@pytest.mark.parametrize("arch, fields", [("qwen2-tied", {}),
                                          ("gemma3", dict(sliding_window=4, final_logit_softcapping=3.0))])
def test_fused_head_with_shared_prompts_equals_plain_autograd_float64(tiny_ckpt_factory, arch, fields):
    """Both fast paths together (shared-prompt forward + in-forward head gradients) == the plain autograd path;
    Gemma 3's: a window shorter than the rows and the soft cap through the fused head's backward."""
    model = load_model(tiny_ckpt_factory(arch, **fields), dtype=torch.float64)
    cfg = resolve(LossConfig(loss="dapo", beta=0.05, entropy_coef=0.02))
    grads = {}
    for fast in (True, False):
        batch = _grouped_batch(model.config.vocab_size, share=fast)
        assert (batch.prompt_index is not None) == fast
        batch.old_logp, batch.ref_logp = _old_and_ref(model, batch)
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, batch, cfg, 16, temperature=0.8, chunk_size=3, fused_head=fast)
        grads[fast] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=1e-10)


@pytest.mark.parametrize("cfg", [
    resolve(LossConfig(loss="dapo", rollout_correction="tis", rollout_correction_cap=1.3)),
    resolve(LossConfig(loss="sapo", rollout_correction="mis", rollout_correction_cap=1.5)),
], ids=["tis", "sapo-mis"])
@pytest.mark.parametrize("mu_above_1", [False, True])
def test_fused_head_with_rollout_correction_equals_autograd_float64(tiny_ckpt_factory, cfg, mu_above_1):
    """Token-level corrections through the in-forward head gradients == autograd, with one pass (pi_train =
    the current policy, detached) and with old log-probs (pi_train = the old policy)."""
    model = load_model(tiny_ckpt_factory("qwen2"), dtype=torch.float64)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        current = batch_logprobs(model, batch, 10_000, temperature=0.9, chunk_size=4)
    noise = 0.4 * torch.randn(current.shape, generator=torch.Generator().manual_seed(4))  # [B, T]
    batch.sampler_logp = (current + noise) * batch.completion_mask  # an injected sampler/trainer mismatch
    if mu_above_1:
        batch.old_logp, _ = _old_and_ref(model, batch)
    grads, stats = {}, {}
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        stats[fused] = accumulate_gradients(model, batch, cfg, 12, temperature=0.9, chunk_size=4, fused_head=fused)
        grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert 0 < stats[True].metrics["rollout_correction_frac"] < 1  # the correction is live
    assert stats[True].metrics == pytest.approx(stats[False].metrics, rel=1e-12, abs=1e-12)
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=1e-10)
    if not mu_above_1:  # one pass: the mismatch is exactly the injected noise (float32 storage of the sampler's)
        active = batch.completion_mask.bool()
        d = noise[active].double()
        assert stats[True].metrics["mismatch_max_abs"] == pytest.approx(float(d.abs().max()), abs=1e-6)
        assert stats[True].metrics["mismatch_mean_abs"] == pytest.approx(float(d.abs().mean()), abs=1e-6)


def test_combine_metrics_mismatch_mean_weighted_and_max_of_maxima():
    # micro-batches of 2 and 6 tokens: mean |d| (0.1 * 2 + 0.3 * 6) / 8 = 0.25, max max(0.5, 0.4) = 0.5
    parts = [{"active_tokens": 2.0, "mismatch_mean_abs": 0.1, "mismatch_max_abs": 0.5, "mismatch_k3": 0.02},
             {"active_tokens": 6.0, "mismatch_mean_abs": 0.3, "mismatch_max_abs": 0.4, "mismatch_k3": 0.06}]
    out = combine_metrics(parts)
    assert out["mismatch_mean_abs"] == pytest.approx(0.25) and out["mismatch_max_abs"] == 0.5
    assert out["mismatch_k3"] == pytest.approx(0.05) and out["active_tokens"] == 8.0


def _zero_group_batch(vocab: int):
    """_grouped_batch with the second prompt's group at advantage 0 (a zero-variance group) and one more row at 0."""
    batch = _grouped_batch(vocab, share=True)
    batch.advantages[3:6] = 0.0
    batch.advantages[0] = 0.0
    return batch


@pytest.mark.parametrize("cfg,inert", [
    (resolve(LossConfig(loss="grpo")), True),
    (resolve(LossConfig(loss="gspo", rollout_correction="mis", rollout_correction_level="sequence")), True),
    (resolve(LossConfig(loss="cispo", dual_clip_c=3.0)), True),
    (resolve(LossConfig(loss="sapo")), True),
    (resolve(LossConfig(loss="grpo", beta=0.04)), False),  # KL acts on every token
    (resolve(LossConfig(loss="dapo", entropy_coef=0.01)), False),  # so does the entropy bonus
    (resolve(LossConfig(loss="grpo", entropy_top_quantile=0.5)), False),  # the quantile is over the call's tokens
], ids=["grpo", "gspo-mis", "cispo-dual", "sapo", "kl", "entropy", "top-entropy"])
def test_rows_without_advantage_leave_the_gradient_unchanged_float64(tiny_ckpt_factory, cfg, inert):
    """The update over rows_with_signal(batch), normalised by the whole batch's totals, has the whole batch's
    gradient to 1e-12 exactly when zero_advantage_is_inert says so (and differs when it says not)."""
    from grpo_engine.rl.losses import zero_advantage_is_inert
    from grpo_engine.train.batch import rows_with_signal

    assert zero_advantage_is_inert(cfg) is inert
    model = load_model(tiny_ckpt_factory("qwen2-tied"), dtype=torch.float64)
    batch = _zero_group_batch(model.config.vocab_size)
    batch.old_logp, batch.ref_logp = _old_and_ref(model, batch)
    kept = rows_with_signal(batch)
    assert kept.advantages.tolist() == [batch.advantages[i].item() for i in (1, 2, 6, 7)]  # not 0, 3-5 or masked 8
    totals = (batch.active_tokens(), batch.active_rows())
    grads = {}
    for name, b in (("all", batch), ("kept", kept)):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, b, cfg, 10_000, temperature=0.8, chunk_size=3, totals=totals)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    gap = max(float((grads["all"][n] - grads["kept"][n]).abs().max()) for n in grads["all"])
    assert (gap < 1e-12) is inert, gap


def test_rows_with_signal_keeps_a_full_batch_and_drops_an_empty_one():
    from grpo_engine.train.batch import rows_with_signal

    batch = _grouped_batch(32, share=True)
    batch.advantages[4] = 0.5  # linspace(-1, 1, 9) has a 0 at row 4
    batch.completion_mask[8] = 1.0  # the masked row trains too
    batch.completion_mask[8, : int(batch.prompt_lengths[8])] = 0.0
    assert rows_with_signal(batch) is batch
    batch.advantages.zero_()
    assert rows_with_signal(batch) is None


def test_an_update_without_rows_still_steps_the_optimizer(tiny_ckpt):
    """All advantages 0 and every row left out: AdamW moves the weights exactly as it does with the zero gradient
    of the full batch (momentum from the step before), instead of skipping the step."""
    from grpo_engine.train.update import UpdateSettings, update_policy

    weights = {}
    for drop in (False, True):
        model = load_model(tiny_ckpt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
        s = UpdateSettings(resolve(LossConfig(loss="grpo")), mu=1, grad_clip=1.0, temperature=1.0, chunk_size=4,
                           auto_halve=False)
        update_policy(model, opt, _batch(model.config.vocab_size), s, 10_000)  # momentum from a real step
        zero = _batch(model.config.vocab_size)
        zero.advantages.zero_()
        totals = (zero.active_tokens(), zero.active_rows())
        out = update_policy(model, opt, None if drop else zero, s, 10_000, totals=totals)
        assert not out.skipped
        weights[drop] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, w in weights[False].items():
        torch.testing.assert_close(weights[True][name], w, rtol=0, atol=0)


def test_update_with_in_place_weight_gradients_and_checkpointing_steps_every_weight_as_float64(tiny_ckpt_factory,
                                                                                              monkeypatch):
    """The trainer's update accumulates the planned oneDNN weights' gradients in place (the model's
    kernels.weight_grads_in_place); with shared prompts, several micro-batches and activation checkpointing, one SGD
    step (lr 1, w - grad) moves every weight as float64 autograd's gradient says."""
    import copy

    from grpo_engine.kernels import KernelPlan, apply_activation_checkpointing, apply_kernels, onednn
    from grpo_engine.kernels.select import shape_key, weight_shapes
    from grpo_engine.train.update import UpdateSettings, update_policy

    model = load_model(tiny_ckpt_factory("qwen2-tied"))
    reference = copy.deepcopy(model).double()
    batch = _grouped_batch(model.config.vocab_size, share=True)
    cfg = resolve(LossConfig(loss="dapo"))
    accumulate_gradients(reference, batch, cfg, 16, temperature=1.0, chunk_size=3)
    shapes = [shape_key(s) for s in weight_shapes(model)]
    apply_kernels(model, KernelPlan("cpu", torch.__version__, 1, dict.fromkeys(shapes, "onednn"),
                                    weight_grad=dict.fromkeys(shapes, "inplace")))
    apply_activation_checkpointing(model, every=1).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    in_place, real = [], onednn._accumulate_weight_grad
    monkeypatch.setattr(onednn, "_accumulate_weight_grad", lambda w, *a: in_place.append(w) or real(w, *a))
    settings = UpdateSettings(cfg, mu=1, grad_clip=0.0, temperature=1.0, chunk_size=3, auto_halve=False)
    update_policy(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, settings, 16)
    assert len({id(w) for w in in_place}) == 7 * model.config.num_hidden_layers  # every projection, in place
    for name, p in reference.named_parameters():
        torch.testing.assert_close((before[name] - dict(model.named_parameters())[name]).double(), p.grad,
                                   rtol=1e-4, atol=1e-6, msg=name)


def test_cpu_update_allocates_every_gradient_before_the_first_micro_batch(tiny_ckpt_factory, monkeypatch):
    """update_policy on the CPU gives every trainable weight a zero gradient before its first micro-batch (why:
    GRADS_FIRST in train/update.py), and the gradients it then holds are those of the pass without that: zeros
    plus the first micro-batch's gradient are that gradient to the bit."""
    import copy

    import grpo_engine.train.update as update
    from grpo_engine.train.update import UpdateSettings, update_policy

    model = load_model(tiny_ckpt_factory("qwen2-tied")).train()
    plain = copy.deepcopy(model)
    batch = _grouped_batch(model.config.vocab_size, share=True)
    cfg = resolve(LossConfig(loss="dapo"))
    accumulate_gradients(plain, batch, cfg, 16, temperature=1.0, chunk_size=3)  # gradients made by backward
    seen, real = [], update.accumulate_gradients
    monkeypatch.setattr(update, "accumulate_gradients", lambda m, *a, **k: seen.append(
        [p.grad is not None and not p.grad.any() for p in m.parameters()]) or real(m, *a, **k))
    settings = UpdateSettings(cfg, mu=1, grad_clip=0.0, temperature=1.0, chunk_size=3, auto_halve=False)
    update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, settings, 16, keep_grads=True)
    assert seen and all(seen[0])  # every gradient there, all zeros, before the pass
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_weights_finite_checks_the_trainable_weights_only(tiny_ckpt):
    """The post-update guard looks at what an update can change: a NaN in a trainable weight is caught, one in a
    frozen weight (a LoRA base, an NF4 base that has no norm kernel) is not looked at."""
    from grpo_engine.train.update import weights_finite
    from grpo_engine.world import World

    model = load_model(tiny_ckpt)
    world = World()
    assert weights_finite(model, world)
    frozen, trained = model.layers[0].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight
    frozen.requires_grad_(False)
    with torch.no_grad():
        frozen[0, 0] = float("nan")
    assert weights_finite(model, world)
    with torch.no_grad():
        trained[0, 0] = float("inf")
    assert not weights_finite(model, world)
    model.requires_grad_(False)
    assert weights_finite(model, world)  # nothing trainable: nothing an update could break
