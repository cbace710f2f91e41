"""Unit tests of the training pieces that need no target model: layout, loss, data helpers."""

from __future__ import annotations

import random

import pytest
import torch

from adapt.data import Example, StepBatches, build_draft_vocab, make_batches, mix_replay, pack_rows, token_counts
from adapt.drafter import build_draft_inputs
from adapt.layout import build_layout, chain_depths
from adapt.loss import Features, collate, label_rows, peagle_loss
from tests.peagle_support import small_drafter

T, F = True, False


def test_layout_by_hand():
    # One sequence x0..x4, assistant tokens x2..x4, K=3.
    lay = build_layout([torch.tensor([F, F, T, T, T])], k=3)
    # Real slots i=0..3 hold x_{i+1}, h_i at position i; chains: anchor 0 -> depths 2,3
    # (labels x3, x4); anchor 1 -> depth 2 (label x4; depth 3 would need x5); anchor 2,3 -> none.
    assert lay.tok_index.tolist() == [1, 2, 3, 4, -1, -1, -1]
    assert lay.hid_index.tolist() == [0, 1, 2, 3, -1, -1, -1]
    assert lay.positions.tolist() == [0, 1, 2, 3, 1, 2, 2]
    assert lay.depth.tolist() == [1, 1, 1, 1, 2, 3, 2]
    assert lay.anchor.tolist() == [0, 1, 2, 3, 0, 0, 1]
    # Target distribution = target logits at position anchor + depth (label x_{anchor+depth+1}).
    assert lay.tgt_index.tolist() == [1, 2, 3, 4, 2, 3, 3]
    # Real slot 3 would predict x5 (absent); real slot 0 predicts x2 (assistant).
    assert lay.valid.tolist() == [T, T, T, F, T, T, T]
    expected = torch.tensor([
        # r0 r1 r2 r3 m0,2 m0,3 m1,2
        [1, 0, 0, 0, 0, 0, 0],  # real 0
        [1, 1, 0, 0, 0, 0, 0],  # real 1
        [1, 1, 1, 0, 0, 0, 0],  # real 2
        [1, 1, 1, 1, 0, 0, 0],  # real 3
        [1, 0, 0, 0, 1, 0, 0],  # anchor 0, depth 2: context <= 0 + itself
        [1, 0, 0, 0, 1, 1, 0],  # anchor 0, depth 3: + its chain's depth 2
        [1, 1, 0, 0, 0, 0, 1],  # anchor 1, depth 2
    ], dtype=torch.bool)
    assert torch.equal(lay.attn_mask, expected)


def test_layout_packs_examples_block_diagonally_and_pads():
    lay = build_layout([torch.tensor([F, T, T]), torch.tensor([F, T, T, T])], k=2, pad_to=12)
    seg = lay.seg
    cross = (seg[:, None] != seg[None, :]) & lay.attn_mask
    assert not cross.any()
    pad = seg < 0
    assert pad.sum() == 12 - int((~pad).sum()) and pad.any()
    assert torch.equal(lay.attn_mask[pad][:, pad], torch.eye(int(pad.sum()), dtype=torch.bool))
    assert not lay.valid[pad].any()
    # Positions restart per example.
    assert lay.positions[(seg == 1) & (lay.depth == 1)].tolist() == [0, 1, 2]


def test_depth_keep_gives_nested_chains():
    lm = torch.ones(400, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    deepest = chain_depths(lm, 4, [0.5, 0.25, 0.1], g)
    frac = [(deepest >= d).float().mean().item() for d in (2, 3, 4)]
    assert 0.4 < frac[0] < 0.6 and 0.15 < frac[1] < 0.35 and 0.04 < frac[2] < 0.18
    lay = build_layout([lm], 4, [0.5, 0.25, 0.1], torch.Generator().manual_seed(0))
    # Each kept chain is contiguous: a depth-d slot exists only with its depth d-1 slot.
    for d in (3, 4):
        deep = set(lay.anchor[lay.depth == d].tolist())
        assert deep <= set(lay.anchor[lay.depth == d - 1].tolist())


def test_packed_training_equals_vllm_inference_pass():
    """Every chain of the packed layout reproduces vLLM's one-pass parallel draft exactly."""
    k = 3
    m = small_drafter(k)
    n = 9
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 39, (n,), generator=g)
    aux = torch.randn(n, m.config.fc_input_size, generator=g)
    feats = Features(ids, torch.ones(n, dtype=torch.bool), aux, torch.zeros(n, 24), torch.zeros(n, dtype=torch.long))
    batch = collate([[feats]], k, m.config.ptd_token_id)
    with torch.no_grad():
        packed = m(**batch.model_inputs())[0]
    lay = build_layout([feats.loss_mask], k)
    checked = 0
    for i in range(n - 1):
        # vLLM decode step: context x_0..x_i processed, next token x_{i+1} sampled.
        inp = build_draft_inputs(ids[: i + 1], aux[: i + 1], int(ids[i + 1]), m.config)
        idx = inp.pop("sample_index")
        with torch.no_grad():
            ref = m(**inp)[0, idx]  # [K, Vd]: drafts 1..K
        for d in range(1, k + 1):
            slot = ((lay.anchor == i) & (lay.depth == d)).nonzero()
            if slot.numel():
                torch.testing.assert_close(packed[slot[0, 0]], ref[d - 1], rtol=1e-4, atol=1e-5)
                checked += 1
    assert checked == (n - 1) + (n - 3) + (n - 4)  # depth 1 for all anchors; deeper where labels exist


def test_loss_zero_when_drafter_matches_target_and_counts_agreement():
    m = small_drafter(2)
    n = 6
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 39, (n,), generator=g)
    aux = torch.randn(n, m.config.fc_input_size, generator=g)
    feats = Features(ids, torch.tensor([F, F, T, T, T, T]), aux, torch.zeros(n, 24), torch.zeros(n, dtype=torch.long))
    batch = collate([[feats]], 2, m.config.ptd_token_id)
    with torch.no_grad():
        logits = m(**batch.model_inputs())
    batch.target_logits = logits[batch.valid].clone()
    pred = logits.argmax(-1)
    batch.target_argmax = pred + m.d2t[pred]
    out = peagle_loss(logits, batch, m.d2t, [1.0, 0.5], 2)
    assert out.loss.abs() < 1e-5
    assert out.depth_acc.tolist() == [1.0, 1.0]
    assert out.depth_count.tolist() == [4.0, 3.0]  # depth 1: labels x2..x5; depth 2: x3..x5
    # A different target gives a positive loss and weights depths as configured.
    batch.target_logits = torch.randn_like(logits[batch.valid])
    out = peagle_loss(logits, batch, m.d2t, [1.0, 0.5], 2)
    torch.testing.assert_close(out.loss, out.depth_loss[0] + 0.5 * out.depth_loss[1])
    assert (out.depth_loss > 0).all()


@pytest.mark.parametrize("num_layers", [1, 2])
def test_loss_over_selected_slots_equals_loss_over_all_slots(num_layers):
    m = small_drafter(3, num_layers)
    g = torch.Generator().manual_seed(5)
    feats = []
    for n, mask in ((7, [F, F, F, T, T, T, T]), (5, [F, T, T, F, T])):
        feats.append(Features(torch.randint(0, 39, (n,), generator=g), torch.tensor(mask),
                              torch.randn(n, m.config.fc_input_size, generator=g), torch.randn(n, 24, generator=g),
                              torch.randint(0, 39, (n,), generator=g)))
    batch = collate([feats], 3, m.config.ptd_token_id)
    assert 0 < int(batch.valid.sum()) < batch.valid.numel()
    grads = []
    for select in (None, batch.valid):
        m.zero_grad()
        out = peagle_loss(m(**batch.model_inputs(), select=select), batch, m.d2t, [1.0, 0.8, 0.6], 3)
        out.loss.backward()
        grads.append((out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (full, g_full), (sel, g_sel) = grads
    torch.testing.assert_close(full.loss, sel.loss)
    assert full.depth_acc.tolist() == sel.depth_acc.tolist() and full.depth_count.tolist() == sel.depth_count.tolist()
    assert g_full.keys() == g_sel.keys() and "fc.weight" in g_full
    for n in g_full:
        torch.testing.assert_close(g_full[n], g_sel[n], rtol=1e-4, atol=1e-6)


def test_segment_attention_equals_the_dense_masked_pass():
    """Example-by-example attention (causal real slots, masked chains) gives the dense pass's logits and grads."""
    m = small_drafter(3).train()
    g = torch.Generator().manual_seed(7)

    def feat(n, mask):
        return Features(torch.randint(0, 39, (n,), generator=g), torch.tensor(mask),
                        torch.randn(n, m.config.fc_input_size, generator=g), torch.randn(n, 24, generator=g),
                        torch.randint(0, 39, (n,), generator=g))

    rows = [[feat(7, [F, F, F, T, T, T, T]), feat(5, [F, T, T, F, T]), feat(3, [F, T, T])],
            [feat(6, [F, F, T, T, T, T])]]  # shorter row: padded
    batch = collate(rows, 3, m.config.ptd_token_id, [0.7, 0.4], torch.Generator().manual_seed(3))
    assert [len(s) for s in batch.segments] == [3, 1]
    assert batch.segments[1][-1][2] < batch.valid.shape[1]  # the second row has padding slots
    results = []
    for segments in (None, batch.segments):
        m.zero_grad()
        inputs = {**batch.model_inputs(), "segments": segments}
        logits = m(**inputs)
        peagle_loss(logits, batch, m.d2t, [1.0, 0.8, 0.6], 3).loss.backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (dense, g_dense), (seg, g_seg) = results
    real = batch.depth > 0
    torch.testing.assert_close(seg[real], dense[real], rtol=1e-4, atol=1e-5)
    for n in g_dense:
        torch.testing.assert_close(g_seg[n], g_dense[n], rtol=1e-4, atol=1e-6)


def test_compact_target_logits_collate_like_full_ones():
    g = torch.Generator().manual_seed(6)
    full, compact = [], []
    for n, mask in ((7, [F, F, F, T, T, T, T]), (6, [F, T, T, F, F, T])):
        lm = torch.tensor(mask)
        f = Features(torch.randint(0, 39, (n,), generator=g), lm, torch.randn(n, 8, generator=g),
                     torch.randn(n, 24, generator=g), torch.randint(0, 39, (n,), generator=g))
        rows = label_rows(lm)
        assert rows.tolist() == [j for j in range(n - 1) if mask[j + 1]]
        full.append(f)
        compact.append(Features(f.input_ids, lm, f.aux_hidden, f.target_logits[rows], f.target_argmax, rows))
    a, b = collate([full], 3, 38), collate([compact], 3, 38)
    assert torch.equal(a.valid, b.valid) and int(a.valid.sum()) > 0
    torch.testing.assert_close(a.target_logits, b.target_logits, rtol=0, atol=0)
    # Each valid slot's row is the target distribution at the position its label follows.
    lay = build_layout([f.loss_mask for f in full], 3)
    want = torch.cat([f.target_logits for f in full])[lay.tgt_index[lay.valid]]
    assert a.target_logits.shape == (int(a.valid.sum()), 24)
    torch.testing.assert_close(a.target_logits, want, rtol=0, atol=0)
    assert torch.equal(a.target_argmax, b.target_argmax)
    # Keeping too few rows is caught, not trained on zeros.
    narrow = compact[0]
    narrow = Features(narrow.input_ids, narrow.loss_mask, narrow.aux_hidden, narrow.target_logits[:1],
                      narrow.target_argmax, narrow.logit_rows[:1])
    with pytest.raises(ValueError, match="logit_rows"):
        collate([[narrow]], 3, 38)


def test_build_draft_vocab_frequency_specials_and_offsets():
    counts = torch.tensor([0, 5, 9, 1, 9, 0, 3, 0])
    d2t, t2d = build_draft_vocab(counts, 4, special_ids=[7])
    ids = torch.arange(4) + d2t
    assert ids.tolist() == [1, 2, 4, 7]  # 2 and 4 (9), 1 (5), eos 7 forced in; sorted
    assert t2d.tolist() == [F, T, T, F, T, F, F, T]
    d2t2, _ = build_draft_vocab({2: 9, 4: 9, 1: 5, 6: 3}, 4, vocab_size=8)
    assert (torch.arange(4) + d2t2).tolist() == [1, 2, 4, 6]
    ex = Example(torch.tensor([1, 2, 2, 3]), torch.tensor([F, T, T, T]), "h")
    assert token_counts([ex], 5).tolist() == [0, 0, 2, 1, 0]


def test_mix_replay_is_seeded_sized_and_deduplicated():
    new = [{"content_hash": f"n{i}", "conversations": []} for i in range(7)]
    old = [{"content_hash": f"o{i}", "conversations": []} for i in range(50)] + [new[0]]
    a = mix_replay(new, old, 0.3, seed=1)
    assert a == mix_replay(new, old, 0.3, seed=1)
    assert a[:7] == new and len(a) == 10  # 3 replayed = 30% of the mix
    assert a != mix_replay(new, old, 0.3, seed=2)
    assert len(mix_replay(new, old, 0.0)) == 7
    assert sum(r is new[0] for r in mix_replay(new, old, 1.0)) == 1


def test_a_fine_tune_trains_on_what_came_after_its_parents_data_and_replays_the_rest():
    from datetime import datetime, timezone

    from adapt.data import newest_time, split_new

    def row(h: str, minute: int | None) -> dict:
        when = None if minute is None else datetime(2026, 11, 29, 12, minute, tzinfo=timezone.utc)
        return {"content_hash": h, "inference_time": when, "conversations": []}

    rows = [row("a", 0), row("b", 10), row("c", 20), row("d", 30), row("e", None)]
    assert newest_time(rows) == "2026-11-29T12:30:00+00:00" and newest_time([row("x", None)]) is None
    # ISO text (JSONL rows), naive times (UTC) and other zones compare as the same instants.
    assert newest_time([{"inference_time": "2026-11-29T13:05:00+01:00"}, {"inference_time": "2026-11-29T12:01:00"}]) \
        == "2026-11-29T12:05:00+00:00"
    # The parent's era is everything up to the newest row it trained on, sampled into its replay or not;
    # a row without a time goes by the hashes the parent lists.
    parent = {"data_until": "2026-11-29T12:10:00+00:00", "content_hashes": ["a", "e"]}
    new, old = split_new(rows, parent)
    assert [r["content_hash"] for r in new] == ["c", "d"] and [r["content_hash"] for r in old] == ["a", "b", "e"]
    # A parent that recorded no time (imported, or trained before it was recorded): its hashes alone.
    new, old = split_new(rows, {"content_hashes": ["a", "b"]})
    assert [r["content_hash"] for r in new] == ["c", "d", "e"] and [r["content_hash"] for r in old] == ["a", "b"]
    assert split_new(rows, None) == (rows, []) and split_new(rows, {}) == (rows, [])
    # What the cycle then trains on: the new rows and a replay_ratio share of the older ones.
    new, old = split_new(rows, parent)
    mixed = mix_replay(new, old, 0.5, seed=0)
    assert mixed[:2] == new and len(mixed) == 4 and all(r in old for r in mixed[2:])


def test_packing_respects_budgets_and_is_seeded():
    lengths = [100, 300, 50, 250, 500, 80, 20]
    rows = pack_rows(lengths, 512)
    assert sorted(i for r in rows for i in r) == list(range(7))
    assert all(sum(lengths[i] for i in r) <= 512 for r in rows)
    b = make_batches(lengths, 600, 512, seed=3)
    assert b == make_batches(lengths, 600, 512, seed=3) and b != make_batches(lengths, 600, 512, seed=3, epoch=1)
    for batch in b:
        assert len(batch) == 1 or sum(lengths[i] for r in batch for i in r) <= 600


def test_step_batches_are_a_pure_function_of_the_step_and_split_between_ranks():
    """A resumed run (a fresh StepBatches at step n) sees what an uninterrupted one does; ranks never share a batch."""
    lengths = [random.Random(i).randint(5, 60) for i in range(40)]
    one = StepBatches(lengths, 100, 64, seed=3)
    seq = [one(s) for s in range(3 * one.per_epoch + 2)]
    assert one.per_epoch == len(make_batches(lengths, 100, 64, 3, 0))
    assert seq[:one.per_epoch] == make_batches(lengths, 100, 64, 3, 0)
    # Later epochs reshuffle and may pack into another count of batches: the steps per epoch stay epoch 0's.
    e1 = make_batches(lengths, 100, 64, 3, 1)
    assert seq[one.per_epoch:2 * one.per_epoch] == [e1[i % len(e1)] for i in range(one.per_epoch)]
    for s in (0, one.per_epoch + 1, 3 * one.per_epoch + 1):
        assert StepBatches(lengths, 100, 64, seed=3)(s) == seq[s]
    ranks = [StepBatches(lengths, 100, 64, seed=3, rank=r, world=2) for r in range(2)]
    assert ranks[0].per_epoch == ranks[1].per_epoch == one.per_epoch // 2
    for s in range(2 * ranks[0].per_epoch):
        assert ranks[0](s) != ranks[1](s)
    epoch0 = [ranks[r](s) for s in range(ranks[0].per_epoch) for r in range(2)]
    assert epoch0 == make_batches(lengths, 100, 64, 3, 0)[:len(epoch0)]
