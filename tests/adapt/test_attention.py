"""Attention backends, slot plans and batched featurization against their references (small shapes, CPU)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from adapt.attention import SHAPES, SlotAttention, candidates, pick_backend, unavailable_reason
from adapt.layout import attention_mask, build_layout
from adapt.loss import Features, collate, peagle_loss
from tests.peagle_support import small_drafter


def random_rows(seed: int, fc_in: int, rows: int = 2) -> list[list[Features]]:
    """Rows of 1-3 examples of 3-14 tokens with random assistant spans (some rows shorter: padding)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        row = []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(3, 14)
            mask = torch.tensor([rng.random() < 0.6 for _ in range(n)])
            row.append(Features(torch.randint(0, 39, (n,), generator=g), mask, torch.randn(n, fc_in, generator=g),
                                torch.randn(n, 24, generator=g), torch.randint(0, 39, (n,), generator=g)))
        out.append(row)
    return out


@pytest.mark.parametrize("k, depth_keep", [(2, []), (3, [0.7, 0.4]), (5, [0.9, 0.5, 0.5, 0.2]), (7, [0.6])])
def test_slot_plans_lay_a_batch_out_as_build_layout_does(k, depth_keep):
    """Cached per-example plans + one draw per anchor give the reference layout, draw for draw."""
    for seed in range(4):
        rows = random_rows(seed, 12, rows=3)
        batch = collate(rows, k, 39, depth_keep, torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        S = batch.depth.shape[1]
        for r, row in enumerate(rows):
            lay = build_layout([f.loss_mask for f in row], k, depth_keep, g, pad_to=S)
            assert torch.equal(batch.depth[r], lay.depth) and torch.equal(batch.positions[r], lay.positions)
            assert torch.equal(batch.valid[r], lay.valid) and torch.equal(batch.seg[r], lay.seg)
            assert torch.equal(batch.attn_mask[r], lay.attn_mask)
            assert torch.equal(batch.is_mask[r], lay.tok_index < 0)
            real = lay.tok_index >= 0
            ids = torch.cat([f.input_ids for f in row])
            assert torch.equal(batch.input_ids[r][real], ids[lay.tok_index[real]])
        assert torch.equal(batch.valid_index, batch.valid.flatten().nonzero().squeeze(1))


def grads_of(m, batch, **kw):
    m.zero_grad()
    logits = m(**kw)
    out = peagle_loss(logits, batch, m.d2t, [1.0, 0.8, 0.6], m.config.num_speculative_tokens)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("k, num_layers", [(2, 1), (4, 2), (7, 2)])
def test_every_cpu_backend_trains_like_the_dense_reference(k, num_layers):
    """Loss and gradients of each backend, on its own layout (rows or one flat row), equal the dense pass's."""
    m = small_drafter(k, num_layers, seed=k * 10 + num_layers).train()
    keep = [0.8, 0.5] if k > 2 else []
    for seed in range(2):
        rows = random_rows(100 + seed, m.config.fc_input_size)
        ref_batch = collate(rows, k, 39, keep, torch.Generator().manual_seed(seed))
        ref, g_ref = grads_of(m, ref_batch, **{**ref_batch.model_inputs(), "segments": None})
        for backend in ("sdpa", "segment"):
            for flat in (False, True):
                b = collate(rows, k, 39, keep, torch.Generator().manual_seed(seed), flat=flat,
                            pad_multiple=16 if flat else 1)
                out, g = grads_of(m, b, **b.drafter_inputs(), attention=b.attention(backend), select=b.valid_index)
                torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
                assert torch.equal(out.depth_count, ref.depth_count)
                torch.testing.assert_close(out.depth_acc, ref.depth_acc)
                assert g.keys() == g_ref.keys()
                for n in g_ref:
                    torch.testing.assert_close(g[n], g_ref[n], rtol=1e-4, atol=1e-6)


def test_flex_block_mask_is_the_layout_rule_and_its_forward_matches_the_dense_pass():
    """FlexAttention's mask_mod, evaluated at every pair, is the layout's mask; its forward gives the dense
    logits. (torch has no FlexAttention backward on CPU: its gradients are checked by
    benchmarks/train_step.py on CUDA, whose max_abs_diff covers loss and gradients.)"""
    from torch.nn.attention.flex_attention import create_mask

    m = small_drafter(3, 2, seed=32)
    rows = random_rows(7, m.config.fc_input_size)
    flat = collate(rows, 3, 39, [0.7], torch.Generator().manual_seed(1), flat=True, **{"pad_multiple": SHAPES["flex"].pad_multiple})
    assert flat.depth.shape == (1, 128) and (flat.seg < 0).any()
    att = flat.attention("flex")
    dense = create_mask(att.block_mask.mask_mod, 1, 1, 128, 128, device="cpu")[:, 0]
    assert torch.equal(dense, flat.attn_mask)
    lay = build_layout([f.loss_mask for row in rows for f in row], 3, [0.7], torch.Generator().manual_seed(1), pad_to=128)
    assert torch.equal(dense[0], lay.attn_mask) and torch.equal(lay.attn_mask, attention_mask(lay.seg, lay.anchor, lay.depth))
    with torch.no_grad():
        got = m(**flat.drafter_inputs(), attention=att, select=flat.valid_index)
        want = m(**flat.drafter_inputs(), attention=flat.attention("sdpa"), select=flat.valid_index)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_backends_available_per_device_and_a_clear_error_for_flex_on_cpu(tiny_model, tmp_path):
    from adapt.train import train
    from settings.config import load_config

    assert candidates(torch.device("cpu")) == ["sdpa", "segment"]
    assert candidates(torch.device("cuda", 0)) == ["flex", "sdpa", "segment"]
    assert "no backward" in unavailable_reason("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        SlotAttention("dense", torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                      torch.ones(1, 2, dtype=torch.long))
    cfg = load_config(None, {"state_dir": str(tmp_path / "s"), "target": {"model": str(tiny_model)},
                             "training": {"attention": "flex", "max_steps": 1, "device": "cpu"}})
    with pytest.raises(ValueError, match="attention = 'flex'.*no backward"):
        train(cfg, [], None, tmp_path / "head", progress=False)


def test_auto_picks_the_fastest_by_measurement_and_caches_it():
    cost = {"flex": 0.02, "sdpa": 0.004, "segment": 0.012}
    runs: list[str] = []

    def run(name, i):
        runs.append(name)
        if name == "flex":
            raise NotImplementedError("no kernel here")
        time.sleep(cost[name])

    pick = pick_backend(["flex", "sdpa", "segment"], run, lambda: None, key=("test", 1), reps=3)
    assert pick.backend == "sdpa" and pick.how == "measured"
    assert "NotImplementedError" in pick.skipped["flex"] and "flex" not in pick.measured
    # segment is three times slower: it stops after its first timed run, sdpa gets all three.
    assert len(pick.measured["sdpa"]) == 3 and len(pick.measured["segment"]) == 1
    assert pick.to_json()["median_ms"]["sdpa"] < pick.to_json()["median_ms"]["segment"] and pick.to_json()["clear_win"]
    before = len(runs)
    again = pick_backend(["flex", "sdpa", "segment"], run, lambda: None, key=("test", 1))
    assert again.backend == "sdpa" and again.how == "cached" and len(runs) == before


def test_auto_picks_the_backend_faster_on_most_batches_not_the_one_that_drew_a_cheap_batch():
    """Timed batches differ (and load comes and goes): sdpa's median time is the lower one here only because
    it ran a cheap first batch, while segment is faster on two batches of three."""
    ms = {"sdpa": {1: 18, 2: 30, 3: 22}, "segment": {1: 24, 2: 26, 3: 13}}

    def run(name, i):
        time.sleep(ms[name].get(i, 5) / 1000)

    pick = pick_backend(["sdpa", "segment"], run, lambda: None, reps=3)
    med = pick.to_json()["median_ms"]
    assert med["sdpa"] < med["segment"] and pick.backend == "segment"


def test_a_stored_pick_spares_a_later_process_the_timing(tmp_path, monkeypatch):
    """Each cycle trains in a process of its own: the pick is kept in a JSON file by its key, and a process
    that finds it there times nothing; another key, or a damaged file, is timed again."""
    import adapt.attention as attention

    runs: list[str] = []

    def run(name, i):
        runs.append(name)
        time.sleep({"sdpa": 0.004, "segment": 0.012}[name])

    store = tmp_path / "cache" / "attention-picks.json"
    first = pick_backend(["sdpa", "segment"], run, lambda: None, key=("cpu-x", 2, 576), store=store)
    assert first.how == "measured" and first.backend == "sdpa" and store.is_file()
    monkeypatch.setattr(attention, "_picks", {})  # a new process
    before = len(runs)
    again = pick_backend(["sdpa", "segment"], run, lambda: None, key=("cpu-x", 2, 576), store=store)
    assert (again.backend, again.how, len(runs)) == ("sdpa", "cached", before)
    assert again.measured == first.measured
    other = pick_backend(["sdpa", "segment"], run, lambda: None, key=("cpu-x", 2, 960), store=store)
    assert other.how == "measured" and len(runs) > before
    monkeypatch.setattr(attention, "_picks", {})
    store.write_text("{not json")
    assert pick_backend(["sdpa", "segment"], run, lambda: None, key=("cpu-x", 2, 576), store=store).how == "measured"


def test_auto_times_distinct_batches_after_warming_up_on_several():
    """Training's batches differ in shape: a backend fast on a batch it has seen but paying for every new
    shape (a kernel plan built per shape) loses to one that compiles for the first two shapes and then
    runs any shape fast, which timing one repeated batch would have missed."""
    seen: dict[str, set[int]] = {"flex": set(), "sdpa": set()}

    def run(name, i):
        shapes = seen[name]
        if name == "sdpa":
            time.sleep(0.004 if i in shapes else 0.03)
        else:
            time.sleep(0.03 if len(shapes) < 2 else 0.01)
        shapes.add(i)

    pick = pick_backend(["flex", "sdpa"], run, lambda: None, reps=3, warmups=3)
    assert pick.backend == "flex" and seen["flex"] == set(range(6))
    # sdpa's first timed batch (a new shape, as every one) is over twice flex's: it stops there.
    assert seen["sdpa"] == {0, 1, 2, 3} and pick.measured["sdpa"][0] > 25 and "sdpa" in pick.skipped
    assert all(t < 25 for t in pick.measured["flex"])


def test_training_measures_the_backends_once_and_a_resumed_run_keeps_its_pick(tiny_model, tmp_path):
    import json

    from adapt.train import train
    from headspec.validate import validate_head
    from settings.config import load_config

    rows = [{"content_hash": f"a{i}", "conversations": [{"from": "human", "value": "the of and to " * 3},
                                                         {"from": "gpt", "value": "def return import class " * 6}]}
            for i in range(4)]
    cfg = load_config(None, {"state_dir": str(tmp_path / "s"), "target": {"model": str(tiny_model)},
                             "head": {"draft_vocab_size": 256},
                             "training": {"max_steps": 2, "batch_tokens": 200, "max_seq_len": 100, "device": "cpu",
                                          "checkpoint_steps": 1, "seed": 11}})
    part = train(cfg, rows, None, tmp_path / "h", progress=False, stop_after_steps=1)
    att = part.extra["attention"]
    assert att["how"] in ("measured", "cached") and att["backend"] in ("sdpa", "segment")
    assert set(att["measured"]) == {"sdpa", "segment"}
    state = json.loads((tmp_path / "h.run" / "train_state.json").read_text())
    assert state["attention"] == att["backend"]
    done = train(cfg, rows, None, tmp_path / "h", progress=False)
    assert done.steps == 2 and done.extra["attention"] == {**done.extra["attention"], "backend": att["backend"],
                                                            "how": "resumed"}
    assert validate_head(tmp_path / "h", tiny_model).manifest["training"]["attention"] == att["backend"]
