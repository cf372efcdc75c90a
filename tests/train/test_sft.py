"""Supervised warm start: the loss counts only completion tokens, and training fits a tiny dataset."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from grpo_engine import load_model
from grpo_engine.sft.trainer import SFTConfig, lr_at, make_sft_batch, sft_loss, train_sft


def test_batch_masks_only_completion_targets():
    batch = make_sft_batch([([1, 2, 3], [4, 5]), ([6], [7, 8, 9])], pad_id=0, device="cpu")
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    # position t predicts token t+1: row 0 targets 4, 5 (t = 2, 3); row 1 targets 7, 8, 9 (t = 0, 1, 2)
    assert batch.loss_mask.tolist() == [[False, False, True, True], [True, True, True, False]]


def test_loss_equals_manual_cross_entropy(tiny_ckpt):
    model = load_model(tiny_ckpt)
    batch = make_sft_batch([([10, 11, 12], [13, 14]), ([20], [21, 22, 23])], pad_id=0, device="cpu")
    with torch.no_grad():
        logits = model(batch.input_ids)  # [2, 5, V]
        terms = [F.log_softmax(logits[0, t], -1)[batch.input_ids[0, t + 1]] for t in (2, 3)]
        terms += [F.log_softmax(logits[1, t], -1)[batch.input_ids[1, t + 1]] for t in (0, 1, 2)]
        expected = -torch.stack(terms).mean()
        assert abs(sft_loss(model, batch).item() - expected.item()) < 1e-5


def test_target_flags_leave_context_tokens_out_of_the_loss(tiny_ckpt):
    """A third element marks completion tokens that are context (a tool's response): only the others count."""
    model = load_model(tiny_ckpt)
    batch = make_sft_batch([([10, 11], [12, 13, 14, 15], [True, False, False, True]), ([20], [21, 22])],
                           pad_id=0, device="cpu")
    assert batch.loss_mask.tolist() == [[False, True, False, False, True], [True, True, False, False, False]]
    with torch.no_grad():
        logits = model(batch.input_ids)
        terms = [F.log_softmax(logits[0, t], -1)[batch.input_ids[0, t + 1]] for t in (1, 4)]
        terms += [F.log_softmax(logits[1, t], -1)[batch.input_ids[1, t + 1]] for t in (0, 1)]
        assert abs(sft_loss(model, batch).item() + torch.stack(terms).mean().item()) < 1e-5


def test_empty_prompt_trains_on_its_completion_after_the_first_token(tiny_ckpt):
    """An empty prompt: nothing predicts the first completion token, so the targets are the others (it dropped all)."""
    batch = make_sft_batch([([], [7, 8, 9]), ([1, 2], [3, 4])], pad_id=0, device="cpu")
    assert batch.input_ids.tolist() == [[7, 8, 9, 0], [1, 2, 3, 4]]
    # row 0: t = 0, 1 predict 8, 9; row 1: t = 1, 2 predict 3, 4
    assert batch.loss_mask.tolist() == [[True, True, False], [False, True, True]]
    assert batch.input_ids[:, 1:][batch.loss_mask].tolist() == [8, 9, 3, 4]
    flagged = make_sft_batch([([], [7, 8, 9, 10], [True, True, False, True])], pad_id=0, device="cpu")
    assert flagged.loss_mask.tolist() == [[True, False, True]]  # targets 8 and 10; 9 is context
    model = load_model(tiny_ckpt)
    with torch.no_grad():
        logits = model(batch.input_ids)  # [2, 4, V]
        terms = [F.log_softmax(logits[0, t], -1)[batch.input_ids[0, t + 1]] for t in (0, 1)]
        terms += [F.log_softmax(logits[1, t], -1)[batch.input_ids[1, t + 1]] for t in (1, 2)]
        assert abs(sft_loss(model, batch).item() + torch.stack(terms).mean().item()) < 1e-5


def test_a_pair_with_no_target_token_is_refused(tiny_ckpt):
    model, cfg = load_model(tiny_ckpt), SFTConfig(steps=1, batch_size=2, lr=1e-3, warmup_steps=0)
    with pytest.raises(ValueError, match=r"SFT pair 1 \(prompt of 0 tokens, completion of 1\) has no target token"):
        train_sft(model, [([1, 2], [3]), ([], [5])], cfg, pad_id=0)
    with pytest.raises(ValueError, match=r"SFT pair 0 \(prompt of 2 tokens, completion of 0\) has no target token"):
        train_sft(model, [([1, 2], [])], cfg, pad_id=0)


def test_schedule_warmup_then_cosine():
    cfg = SFTConfig(steps=110, lr=1.0, warmup_steps=10)
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert abs(lr_at(60, cfg) - 0.5) < 1e-6  # halfway through the cosine
    assert lr_at(109, cfg) < 1e-3


def test_memorises_a_tiny_dataset(tiny_ckpt):
    torch.manual_seed(0)
    model = load_model(tiny_ckpt)
    pairs = [([65 + i, 61], [48 + i, 258]) for i in range(4)]  # "A=" -> "0<|im_end|>", ...
    losses = train_sft(model, pairs, SFTConfig(steps=60, batch_size=4, lr=1e-2, warmup_steps=5), pad_id=256)
    assert losses[0] > math.log(272) * 0.8  # starts near uniform over the vocabulary
    assert losses[-1] < 0.05


def test_sft_pairs_skip_examples_without_a_reference(tiny_ckpt):
    """A loaded Countdown row has no known solution: it is left out, never passed to the tokenizer as None."""
    import pytest

    from grpo_engine.config import ConfigError
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.sft.warm_start import sft_pairs
    from grpo_engine.tasks import make_task
    from grpo_engine.tasks.countdown import CountdownExample

    task, tok = make_task("countdown", n_train=4, n_test=2), load_tokenizer(tiny_ckpt)
    known = task.examples("train")[:2]
    loaded = CountdownExample("file-0", "Use 3, 4 to make 7", "7", nums=(3, 4), target=7, solution=None)
    pairs = sft_pairs(task, tok, [known[0], loaded, known[1]])
    assert len(pairs) == 2
    assert tok.decode(pairs[1][1][:-1]) == task.reference_completion(known[1])
    with pytest.raises(ConfigError, match="no reference completion for any training example"):
        sft_pairs(task, tok, [loaded])


def test_a_dataset_smaller_than_the_batch_fills_every_batch(tiny_ckpt, monkeypatch):
    """3 pairs, batch_size 4: every step trains on 4 pairs, drawn as whole shuffled epochs (steps once got
    only the 3 left in the order, so the batch size depended on the dataset's size)."""
    from grpo_engine.sft import trainer as sft

    seen = []
    make = sft.make_sft_batch
    monkeypatch.setattr(sft, "make_sft_batch", lambda pairs, pad, dev: seen.append(pairs) or make(pairs, pad, dev))
    pairs = [([65 + i, 61], [48 + i, 258]) for i in range(3)]
    train_sft(load_model(tiny_ckpt), pairs, SFTConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1), pad_id=256)
    assert [len(b) for b in seen] == [4, 4, 4]
    drawn = [p for b in seen for p in b]  # 12 draws = 4 epochs, each a permutation of the 3 pairs
    assert all(sorted(drawn[e * 3 : e * 3 + 3]) == sorted(pairs) for e in range(4))


def test_shared_prefix_runs_once_with_the_same_loss_and_gradients(tiny_ckpt):
    """Rows that start with the same tokens (a system prompt declaring tools): the prefix runs once per batch and
    every row attends to its keys/values; loss and every gradient equal the plain forward's (float64)."""
    from grpo_engine.sft.trainer import shared_prefix_length

    pairs = [([1, 2, 3, 4, 5, 6, 10], [11, 12, 13]), ([1, 2, 3, 4, 5, 6, 20, 21], [22, 23], [False, True]),
             ([1, 2, 3, 4, 5, 6], [31, 32, 33, 34])]
    batch = make_sft_batch(pairs, pad_id=0, device="cpu")
    assert shared_prefix_length(batch) == 5  # position 5 predicts row 2's first target
    model = load_model(tiny_ckpt).double()

    def loss_and_grads(loss_fn):
        model.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    shared, plain = loss_and_grads(sft_loss), loss_and_grads(_plain_loss)
    assert abs(shared[0] - plain[0]) < 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(shared[1], plain[1])) < 1e-6
    assert max(g.abs().max().item() for g in plain[1]) > 1e-3  # (gradients that are there to compare)


def _plain_loss(model, batch):
    hidden = model(batch.input_ids[:, :-1], return_hidden=True)
    logits = model.lm_head(hidden[batch.loss_mask])
    return F.cross_entropy(logits.float(), batch.input_ids[:, 1:][batch.loss_mask])  # as sft_loss: fp32 logits


def _cold_start_config(tmp_path, tiny_ckpt, *overrides):
    """A cold start of an existing model (no tiny base) on the real tools demo's task and teacher, with tools."""
    from grpo_engine.config import load_config
    from grpo_engine.demo import REAL_TOOLS_RECIPE

    return load_config(str(REAL_TOOLS_RECIPE), [f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'run'}",
                                                "task.options.n_train=40", "warm_start.sft.steps=2",
                                                "warm_start.sft.batch_size=4", "warm_start.sft.warmup_steps=0",
                                                "warm_start.sft.examples=8", "rollout.max_new_tokens=6", *overrides])


def test_cold_start_trains_only_the_top_blocks_on_its_first_examples(tiny_ckpt, tmp_path, monkeypatch):
    """warm_start.sft.top_layers=1: only the last block and the final norm change (the tied embedding / LM head and
    the blocks below keep their weights); warm_start.sft.examples=8: the first 8 training problems are its data."""
    from grpo_engine.sft import warm_start as ws
    from grpo_engine.train.setup import task_of

    cfg = _cold_start_config(tmp_path, tiny_ckpt, "warm_start.sft.top_layers=1")
    task, seen = task_of(cfg), []
    make = ws.sft_pairs
    monkeypatch.setattr(ws, "sft_pairs", lambda t, tok, ex, tools: seen.append(list(ex)) or make(t, tok, ex, tools))
    out = ws.warm_start(cfg, task)
    assert seen == [task.examples("train")[:8]]
    before, after = load_model(tiny_ckpt).state_dict(), load_model(out).state_dict()
    last = len([k for k in before if k.endswith("attn_norm.weight")]) - 1
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(f"layers.{last}.") or k.startswith("norm.") for k in changed), changed
    assert json.loads((out / ws.DONE_MARKER).read_text())["sft"]["top_layers"] == 1
    bare = ws._settings(_cold_start_config(tmp_path, tiny_ckpt, "warm_start.sft.examples=0",
                                           "warm_start.sft.top_layers=0", "warm_start.sft.own_answers=false"), "sft")
    assert set(bare["sft"]) == {"steps", "batch_size", "lr", "warmup_steps", "weight_decay", "adam_beta2", "seed"}
    # (the settings added later, at their defaults, are left out: older warm starts' records still match)


def test_own_answers_replace_the_in_head_targets_with_the_models_replies(tiny_ckpt, tmp_path):
    """warm_start.sft.own_answers: a target the teacher answered in its head becomes the model's own greedy reply
    to the same prompt; the teacher's tool conversations (with their target flags) stay."""
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.rollout import SamplingParams, generate
    from grpo_engine.sft.warm_start import own_answers, sft_pairs
    from grpo_engine.train.setup import task_of

    cfg = _cold_start_config(tmp_path, tiny_ckpt)
    task, tok, model = task_of(cfg), load_tokenizer(tiny_ckpt), load_model(tiny_ckpt)
    pairs = sft_pairs(task, tok, task.examples("train")[:8], cfg.tools)
    mine = own_answers(model, tok, pairs, max_new_tokens=6)
    head = [i for i, p in enumerate(pairs) if len(p) == 2]
    assert head and len(head) < len(pairs)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=tok.eos_token_ids)
    replies = generate(model, [pairs[i][0] for i in head], params, tokenizer=tok).completion_ids
    assert [mine[i] for i in head] == [(pairs[i][0], list(r)) for i, r in zip(head, replies)]
    assert [p for i, p in enumerate(mine) if i not in head] == [p for i, p in enumerate(pairs) if i not in head]
