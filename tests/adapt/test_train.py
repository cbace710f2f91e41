"""Training recipe on the tiny target: learning, determinism, resume, warm start, DDP, CLI."""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapt.train import ShapeChangeError, train
from headspec.validate import validate_head
from tests.config_support import make_cfg, tiny_training
from tests.paths import REPO_ROOT

WORDS = "the of and to in is you that it def return import class self print for while if else".split()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The test machine's cores are shared: spinning OpenMP threads slow every step several-fold.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40)))
        rows.append({"content_hash": f"c{seed}-{i}", "inference_time": f"2026-11-29T12:{i % 60:02d}:00+00:00",
                     "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    return rows


@pytest.fixture(scope="module")
def bootstrapped(tiny_model, tmp_path_factory):
    """A head bootstrapped for 30 steps (shared by the learning and warm-start tests)."""
    tmp = tmp_path_factory.mktemp("boot")
    cfg = make_cfg(tmp, **tiny_training(tiny_model, max_steps=30, checkpoint_steps=100))
    res = train(cfg, conversations(24), None, tmp / "head", progress=False)
    return tmp / "head", res


def test_bootstrap_learns_and_exports_a_valid_head(bootstrapped, tiny_model):
    head, res = bootstrapped
    curve = res.loss_curve
    assert res.steps == 30 and len(curve) == 30
    assert sum(curve[-5:]) < 0.85 * sum(curve[:5]), curve
    info = validate_head(head, tiny_model)
    assert info.config.draft_vocab_size == 256 and info.num_speculative_tokens == 3
    m = info.manifest
    assert m["parent"] is None and m["data_snapshot"]["id"] == res.data_snapshot
    assert len(m["data_snapshot"]["content_hashes"]) == 24
    # Its children train on what was captured after this as new (adapt.data.split_new).
    assert m["data_snapshot"]["data_until"] == "2026-11-29T12:23:00+00:00"
    assert m["config"]["training"]["max_steps"] == 30 and m["training"]["steps"] == 30
    # The draft vocabulary always holds the end-of-turn token the target emits.
    w = load_file(str(head / "model.safetensors"))
    assert bool(w["t2d"][2])  # <|im_end|> in the tiny tokenizer
    assert res.tokens_per_s > 0 and len(res.final_depth_loss) == 3


def test_same_seed_same_curve_and_resume_equals_uninterrupted(tiny_model, tmp_path):
    rows = conversations(16, seed=1)
    cfg = make_cfg(tmp_path, **tiny_training(tiny_model, depth_keep=[0.7, 0.5]))
    a = train(cfg, rows, None, tmp_path / "a", progress=False)
    b = train(cfg, rows, None, tmp_path / "b", progress=False)
    assert a.loss_curve == b.loss_curve and len(a.loss_curve) == 6
    # The second run read the target's features the first stored (adapt.feature_store) and trained the same.
    sa, sb = a.extra["feature_store"], b.extra["feature_store"]
    assert sa["writes"] > 0 and sa["hits"] == 0 and sb["hits"] == sa["writes"] and sb["writes"] == 0
    assert b.featurize_seconds < a.featurize_seconds
    off = train(make_cfg(tmp_path, **tiny_training(tiny_model, depth_keep=[0.7, 0.5], feature_store_gb=0)), rows,
                None, tmp_path / "off", progress=False)
    assert "feature_store" not in off.extra and off.loss_curve == a.loss_curve
    # Interrupt after 4 steps (checkpoint at 3 plus the final save), then resume.
    part = train(cfg, rows, None, tmp_path / "c", progress=False, stop_after_steps=4)
    assert part.steps == 4
    c = train(cfg, rows, None, tmp_path / "c", progress=False)
    assert c.steps == 6 and c.loss_curve == a.loss_curve
    wa, wc = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "c" / "model.safetensors"))
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    # A different seed is a different run.
    d = train(make_cfg(tmp_path, **tiny_training(tiny_model, seed=5, depth_keep=[0.7, 0.5])), rows, None,
              tmp_path / "d", progress=False)
    assert d.loss_curve != a.loss_curve


def test_warm_start_keeps_shapes_and_rejects_shape_changes(bootstrapped, tiny_model, tmp_path):
    base, _ = bootstrapped
    base_info = validate_head(base, tiny_model)
    cfg = make_cfg(tmp_path, **tiny_training(tiny_model, max_steps=3, refresh_draft_vocab=False))
    res = train(cfg, conversations(8, seed=2), str(base), tmp_path / "warm",
                replay_conversations=conversations(24), progress=False)
    info = validate_head(tmp_path / "warm", tiny_model)
    assert info.manifest["parent"] == base_info.sha256 == res.parent_sha
    wb, ww = load_file(str(base / "model.safetensors")), load_file(str(tmp_path / "warm" / "model.safetensors"))
    assert {k: v.shape for k, v in wb.items()} == {k: v.shape for k, v in ww.items()}
    assert torch.equal(wb["d2t"], ww["d2t"])  # refresh off: the draft vocabulary is kept
    assert not torch.equal(wb["fc.weight"], ww["fc.weight"])
    # Replay: 8 new + 30% replayed from the 24 old conversations.
    assert res.num_examples == 8 + round(8 * 0.3 / 0.7)
    for override in ({"num_speculative_tokens": 2}, {"draft_vocab_size": 128}, {"num_layers": 2},
                     {"aux_layer_ids": [0, 1, 2]}):
        bad = make_cfg(tmp_path, state_dir=tmp_path / "s", target={"model": str(tiny_model)},
                       head={"draft_vocab_size": 256, **override}, training={"max_steps": 1})
        with pytest.raises(ShapeChangeError):
            train(bad, conversations(4), str(base), tmp_path / "bad", progress=False)


def test_warm_start_refreshes_the_draft_vocabulary_for_drifted_traffic(bootstrapped, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from adapt.checkpoint import load_head
    from adapt.data import tokenize_rows

    base, _ = bootstrapped
    old, _ = load_head(base)
    old_ids = set(old.draft_to_target(torch.arange(256)).tolist())
    # Drifted traffic: words the bootstrap data never had.
    drift = [{"content_hash": f"d{i}", "conversations": [
        {"from": "human", "value": "zebra quantum"},
        {"from": "gpt", "value": " ".join(["zebra quantum lattice vortex nebula", "the of"][i % 2] for _ in range(8))}]}
        for i in range(8)]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    new_tokens = {int(t) for ex in tokenize_rows(tok, drift, 160) for t in ex.input_ids[ex.loss_mask]} - old_ids
    assert new_tokens, "the drift must use tokens outside the bootstrap vocabulary for this test to mean anything"

    res = train(make_cfg(tmp_path, **tiny_training(tiny_model, max_steps=2)), drift, str(base), tmp_path / "warm",
                replay_conversations=conversations(24), progress=False)
    info = validate_head(tmp_path / "warm", tiny_model)  # vLLM-valid d2t/t2d, same shapes
    warm, _ = load_head(tmp_path / "warm")
    warm_ids = set(warm.draft_to_target(torch.arange(256)).tolist())
    assert new_tokens <= warm_ids and len(warm_ids) == 256
    r = res.extra["draft_vocab_refresh"]
    assert r == info.manifest["draft_vocab_refresh"]
    assert r["added_tokens"] == len(warm_ids - old_ids) >= len(new_tokens)
    assert r["coverage_after"] == 1.0 > r["coverage_before"]


def test_feature_cache_budget_bounds_the_processs_real_memory_growth(tiny_model, monkeypatch):
    """Features are cached while both their bytes and the process's growth fit the budget; the rest are
    recomputed on demand, identically."""
    import adapt.features as F
    from adapt.data import tokenize_rows
    from headspec.config import default_aux_layer_ids

    rss = {"now": 1 << 30}
    monkeypatch.setattr(F, "process_rss_bytes", lambda: rss["now"])
    tf = F.TargetFeatures(tiny_model, default_aux_layer_ids(4), torch.arange(64), torch.device("cpu"),
                          cache_bytes=10 << 20)
    examples = tokenize_rows(tf.runner.tokenizer, conversations(5), 160)
    got = []
    for i, ex in enumerate(examples):
        rss["now"] += 4 << 20  # each featurization grows the process by 4 MiB, far above its tensors' bytes
        got.append(tf.get(i, ex))
    assert tf.used_bytes < 1 << 20  # the tensors alone would all have fit
    assert sorted(tf.cache) == [0, 1]  # 8 MiB grown + the third's bytes > 10 MiB: not kept
    again = tf.get(3, examples[3])
    assert again is not got[3] and torch.equal(again.aux_hidden, got[3].aux_hidden)
    assert torch.equal(again.target_rows, got[3].target_rows)
    assert tf.get(1, examples[1]) is got[1]

    monkeypatch.setattr(F, "process_rss_bytes", lambda: None)  # no /proc: the tensors' bytes alone count
    tf2 = F.TargetFeatures(tiny_model, default_aux_layer_ids(4), torch.arange(64), torch.device("cpu"),
                           cache_bytes=10 << 20)
    for i, ex in enumerate(examples):
        tf2.get(i, ex)
    assert sorted(tf2.cache) == [0, 1, 2, 3, 4]


def test_compact_features_give_the_targets_logits_at_a_fraction_of_the_bytes(tiny_model, monkeypatch):
    """Final hidden states projected through the output rows reproduce the full features' logits, batch for batch;
    a target whose logits are not that plain product (here: scaled) keeps full logits."""
    import adapt.features as F
    import adapt.hidden_states as H
    from adapt.data import tokenize_rows
    from adapt.loss import collate, peagle_loss
    from headspec.config import default_aux_layer_ids

    draft = torch.randperm(512, generator=torch.Generator().manual_seed(0))[:200]
    args = (tiny_model, default_aux_layer_ids(4), draft, torch.device("cpu"))
    compact, full = F.TargetFeatures(*args), F.TargetFeatures(*args, compact=False)
    assert compact.compact and not full.compact
    examples = tokenize_rows(compact.runner.tokenizer, conversations(4), 160)
    fc = [compact.get(i, ex) for i, ex in enumerate(examples)]
    ff = [full.get(i, ex) for i, ex in enumerate(examples)]
    for c, f in zip(fc, ff):
        assert c.target_logits is None and c.target_hidden.shape == (len(c.logit_rows), 128)
        torch.testing.assert_close(c.aux_hidden, f.aux_hidden, rtol=0, atol=0)
        assert torch.equal(c.target_argmax, f.target_argmax)
        assert c.nbytes < f.nbytes
    bc = collate([fc[:2], fc[2:]], 3, 0, (), torch.Generator().manual_seed(1))
    bf = collate([ff[:2], ff[2:]], 3, 0, (), torch.Generator().manual_seed(1))
    assert bc.compact and not bf.compact and torch.equal(bc.valid, bf.valid)
    with pytest.raises(ValueError, match="project_targets"):  # hidden states are not logits
        peagle_loss(torch.zeros(int(bc.valid.sum()), 200), bc, torch.zeros(200, dtype=torch.long), [1.0], 3)
    bc.project_targets(compact.output_rows)
    assert bc.target_logits.shape == bf.target_logits.shape == (int(bf.valid.sum()), 200)
    # One bf16 product either way: equal up to an ulp of the logits' scale.
    torch.testing.assert_close(bc.target_logits.float(), bf.target_logits.float(), rtol=0,
                               atol=float(bf.target_logits.float().abs().max()) * 2 ** -7)
    with pytest.raises(ValueError, match="mixes"):
        collate([[fc[0], ff[1]]], 3, 0)

    plain = H.TargetRunner.forward

    def scaled(self, *a, **k):
        aux, logits = plain(self, *a, **k)
        return aux, None if logits is None else logits * 0.5

    monkeypatch.setattr(H.TargetRunner, "forward", scaled)
    assert not F.TargetFeatures(*args).compact


def test_feature_budget_is_shared_by_the_ranks_on_one_machine(monkeypatch):
    from adapt.features import default_cache_bytes

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one = default_cache_bytes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four = default_cache_bytes()
    assert one > 0 and abs(four * 4 - one) < one * 0.05  # MemAvailable may move a little between reads
    assert abs(default_cache_bytes(2) * 2 - one) < one * 0.05


def test_training_releases_its_feature_cache_when_done(tiny_model, tmp_path, monkeypatch):
    """A finished run leaves no cached features behind and trims the heap (vLLM servers may start next)."""
    import adapt.features as F
    import adapt.memory as M
    import adapt.recipe as R

    made, trims = [], []

    class Recording(F.TargetFeatures):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    def trim() -> bool:
        trims.append(len(made[0].cache))
        return True

    monkeypatch.setattr(R, "TargetFeatures", Recording)
    monkeypatch.setattr(M, "trim_heap", trim)  # the loop's heap context
    monkeypatch.setattr(F, "trim_heap", trim)  # the cache's release
    res = train(make_cfg(tmp_path, **tiny_training(tiny_model, max_steps=3)), conversations(8), None,
                tmp_path / "head", progress=False)
    assert len(made) == 1 and made[0].cache == {} and made[0].used_bytes == 0
    # The loop's heap context trims with the cache still held; the release trims once it is gone.
    assert trims[0] > 0 and trims[-1] == 0 and res.featurize_seconds > 0


def test_a_failed_run_still_releases_its_feature_cache(tiny_model, tmp_path, monkeypatch):
    """The recipe's cleanup runs after a failure too (no rank barrier then: the others may never arrive)."""
    import adapt.recipe as R

    made = []

    class Recording(R.TargetFeatures):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    def broken(head_dir, runner):
        assert made[0].cache  # still held while the exported head is evaluated
        raise RuntimeError("estimate failed")

    monkeypatch.setattr(R, "TargetFeatures", Recording)
    with pytest.raises(RuntimeError, match="estimate failed"):
        train(make_cfg(tmp_path, **tiny_training(tiny_model, max_steps=1)), conversations(4), None, tmp_path / "head",
              progress=False, after_export=broken)
    assert made[0].cache == {} and made[0].used_bytes == 0
    assert (tmp_path / "head" / "model.safetensors").is_file()


HEAP_PROBE = r"""
import json, os, statistics
from pathlib import Path
import torch
from adapt.memory import heap_kept_between_steps

def minor_faults():
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])

def step_faults():
    before = minor_faults()
    # two step-sized blocks above glibc's 32 MiB mmap ceiling, freed at the end of the step
    x = torch.ones(64 << 20, dtype=torch.uint8)
    y = torch.ones(48 << 20, dtype=torch.uint8) + 1
    del x, y
    return minor_faults() - before

before = [step_faults() for _ in range(3)]
with heap_kept_between_steps() as kept:
    inside = [step_faults() for _ in range(12)]
after = [step_faults() for _ in range(3)]
print(json.dumps({"kept": kept, "before": before, "inside": inside, "after": after,
                  "pages": (112 << 20) // os.sysconf("SC_PAGE_SIZE")}))
"""


def test_large_blocks_are_reused_inside_training_not_faulted_in_again():
    """A step's large tensors fault their pages in again every step by default; inside the context, once warm, not.

    Which freed block the next allocation fits depends on what small allocations
    landed beside it (torch's aligned allocations carry padding), so the first
    steps may still grow the heap: the claim is about the steady state. The probe
    runs in a fresh interpreter: page faults are counted for the whole process, and
    in the suite's process earlier tests' threads and heap fault pages of their own.
    """
    p = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, timeout=300,
                       cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    pages = r["pages"]
    assert r["kept"]
    assert statistics.median(r["before"]) > pages // 2, r
    assert statistics.median(r["inside"][6:]) < pages // 20, r
    # On exit the heap's free pages go back to the OS, so the next step faults its blocks in again.
    assert r["after"][0] > pages // 2, r


def test_schedule_warms_up_decays_by_steps_and_anneals_before_a_time_cap():
    from adapt.schedule import lr_at

    assert lr_at(0, 1.0, 10, 110) == pytest.approx(0.1)
    assert lr_at(10, 1.0, 10, 110) == pytest.approx(1.0)
    assert lr_at(60, 1.0, 10, 110) == pytest.approx(0.55)  # cosine half way: 0.1 + 0.9 / 2
    assert lr_at(110, 1.0, 10, 110) == pytest.approx(0.1)
    # A wall-time cap that will end the run first moves the decay ahead; it never slows it.
    assert lr_at(10, 1.0, 10, 110, time_used=0.5) == pytest.approx(0.55)
    assert lr_at(10, 1.0, 10, 110, time_used=1.0) == pytest.approx(0.1)
    assert lr_at(60, 1.0, 10, 110, time_used=0.1) == pytest.approx(0.55)
    assert lr_at(50, 1.0, 10, 0) == pytest.approx(1.0)  # no bound: constant after warmup


def test_schedule_needs_a_bound_and_its_clock_starts_with_the_loop(tiny_model, tmp_path, monkeypatch):
    import adapt.schedule as S

    unbounded = make_cfg(tmp_path, **tiny_training(tiny_model, max_steps=0, max_minutes=0))
    with pytest.raises(ValueError, match="needs a bound"):
        S.Schedule(unbounded.training)
    with pytest.raises(ValueError, match="needs a bound"):  # before anything is loaded
        train(unbounded, [], None, tmp_path / "none", progress=False)
    now = {"t": 100.0}
    monkeypatch.setattr(S.time, "monotonic", lambda: now["t"])
    capped = S.Schedule(make_cfg(tmp_path, **tiny_training(tiny_model, max_steps=0, max_minutes=2,
                                                           warmup_steps=0)).training)
    assert capped.capped and capped.max_steps > 1 << 60 and capped.time_used() == 0.0
    now["t"] = 500.0  # setup time does not count
    capped.start()
    now["t"] += 60
    assert capped.time_used() == pytest.approx(0.5) and capped.lr(1000, 0.5) == pytest.approx(2e-3 * 0.55)


@pytest.mark.parametrize("amx, avx512_bf16, want", [(True, False, True), (False, True, True), (False, False, False)])
def test_auto_dtype_is_bf16_where_the_cpu_multiplies_bf16_natively(monkeypatch, amx, avx512_bf16, want):
    from adapt.device import use_bf16_autocast

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    cpu = torch.device("cpu")
    assert use_bf16_autocast("auto", cpu) is want
    assert use_bf16_autocast("fp32", cpu) is False and use_bf16_autocast("bf16", cpu) is True
    assert use_bf16_autocast("auto", torch.device("cuda", 0)) is True


@pytest.mark.parametrize("dtype, native, want", [("auto", False, torch.float32), ("auto", True, torch.bfloat16),
                                                  ("fp32", True, torch.float32), ("bf16", False, torch.bfloat16)])
def test_the_target_featurizes_in_the_steps_precision(tiny_model, tmp_path, monkeypatch, dtype, native, want):
    """Emulated bf16 runs the target several times slower than fp32 on a CPU without bf16 kernels:
    the target runs in the precision the step picks, and its features are kept in bf16 either way."""
    import adapt.features as F
    import adapt.recipe as R

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    made = []

    class Recording(F.TargetFeatures):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(R, "TargetFeatures", Recording)
    train(make_cfg(tmp_path, **tiny_training(tiny_model, max_steps=1, dtype=dtype)), conversations(4), None,
          tmp_path / "head", progress=False)
    assert made[0].runner.model.dtype == want and made[0].output_rows.dtype == want


def test_fp32_features_are_kept_in_bf16_and_match_bf16_ones(tiny_model):
    """The fp32 target's features take the bytes bf16 ones take and differ from them by bf16 rounding:
    the drafter trains on the same inputs either way."""
    from adapt.data import tokenize_rows
    from adapt.features import TargetFeatures
    from headspec.config import default_aux_layer_ids

    args = (tiny_model, default_aux_layer_ids(4), torch.arange(64), torch.device("cpu"))
    lo, hi = TargetFeatures(*args, dtype=torch.bfloat16), TargetFeatures(*args, dtype=torch.float32)
    assert hi.compact and lo.compact
    examples = tokenize_rows(lo.runner.tokenizer, conversations(4, seed=3), 160)
    agree = rows = 0
    for ex in examples:
        a, b = lo.compute(ex), hi.compute(ex)
        assert b.aux_hidden.dtype == b.target_hidden.dtype == torch.bfloat16 and b.nbytes == a.nbytes
        err = (a.aux_hidden.float() - b.aux_hidden.float()).norm() / b.aux_hidden.float().norm()
        assert 0 < err < 0.03
        agree += int((a.target_argmax[a.logit_rows] == b.target_argmax[b.logit_rows]).sum())
        rows += len(a.logit_rows)
    assert agree / rows > 0.95


def test_output_layer_starts_from_the_targets_draft_vocab_rows(tiny_model):
    from adapt.checkpoint import init_output_from_target, new_head, target_output_layer

    model = new_head(tiny_model, 3, 256)
    ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:256].sort().values
    model.set_draft_vocab(ids)
    init_output_from_target(model, tiny_model)
    norm, out_rows = target_output_layer(tiny_model)
    torch.testing.assert_close(model.norm.weight, norm)
    torch.testing.assert_close(model.lm_head.weight, out_rows[ids])


def test_remap_draft_vocab_moves_rows_with_their_tokens(bootstrapped):
    from adapt.checkpoint import load_head

    model, _ = load_head(bootstrapped[0])
    ids = model.draft_to_target(torch.arange(256))
    row = {int(t): model.lm_head.weight[i].clone() for i, t in enumerate(ids)}
    mean = model.lm_head.weight.mean(0).clone()
    outside = sorted(set(range(model.config.vocab_size)) - set(ids.tolist()))[:5]
    new_ids = torch.tensor(sorted(ids.tolist()[5:] + outside))
    assert model.remap_draft_vocab(new_ids) == 5
    got = model.draft_to_target(torch.arange(256))
    assert torch.equal(got, new_ids)
    for i, t in enumerate(got.tolist()):
        want = mean if t in outside else row[t]
        assert torch.allclose(model.lm_head.weight[i], want)


def test_remap_draft_vocab_starts_new_tokens_from_the_target_rows(bootstrapped, tiny_model):
    from adapt.checkpoint import load_head, target_output_layer

    model, _ = load_head(bootstrapped[0])
    _, out_rows = target_output_layer(tiny_model)
    ids = model.draft_to_target(torch.arange(256))
    row = {int(t): model.lm_head.weight[i].clone() for i, t in enumerate(ids)}
    outside = sorted(set(range(model.config.vocab_size)) - set(ids.tolist()))[:5]
    kept = ids.tolist()[5:]
    new_ids = torch.tensor(sorted(kept + outside))
    assert model.remap_draft_vocab(new_ids, out_rows) == 5
    scale = torch.stack([row[t] for t in kept]).norm(dim=-1).mean() / out_rows[kept].norm(dim=-1).mean()
    for i, t in enumerate(model.draft_to_target(torch.arange(256)).tolist()):
        want = out_rows[t] * scale if t in outside else row[t]
        torch.testing.assert_close(model.lm_head.weight[i], want)


def test_cli_train_on_jsonl_reports_losses_and_offline_acceptance(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from app.cli import app
    from settings.config import dump_toml

    cfg = make_cfg(tmp_path, **tiny_training(tiny_model))
    cfg.bench.max_tokens = 8
    conf = tmp_path / "adapt.toml"
    conf.write_text(dump_toml(cfg))
    data, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(10, seed=4)))
    held.write_text("".join(json.dumps(r) + "\n" for r in conversations(2, seed=5)))
    res = CliRunner().invoke(app, ["train", "--config", str(conf), "--data", str(data), "--eval-data", str(held),
                                   "--out", str(tmp_path / "cli-head"), "--max-steps", "4", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["out_dir"] == str(tmp_path / "cli-head") and out["steps"] == 4 and out["tokens_per_s"] > 0
    assert len(out["final_depth_loss"]) == 3
    acc = out["acceptance"]
    assert acc["k"] == 3 and acc["num_prompts"] == 2 and 1.0 <= acc["mean_acceptance_length"] <= 4.0
    validate_head(tmp_path / "cli-head", tiny_model)
    # A bad base is a clean error, not a traceback (``error: ...``, or ``{"error": ...}`` where --json errors are JSON).
    bad = CliRunner().invoke(app, ["train", "--config", str(conf), "--data", str(data), "--base",
                                   str(tmp_path / "nope"), "--json"])
    assert bad.exit_code != 0 and "error" in bad.output and "neither a directory" in bad.output
    assert "Traceback" not in bad.output


def test_adapt_train_gpus_2_runs_itself_as_two_gloo_ranks_under_torchrun(tiny_model, tmp_path):
    """`adapt train --gpus N` launches torchrun (one node, --standalone) with its own arguments: every rank
    trains, rank 0 alone answers, and the head is the DDP run's (world size 2); on CPU the ranks use gloo.
    The CUDA command is the same line on a GPU host."""
    from app.commands.train import torchrun_argv
    from settings.config import dump_toml

    cfg = make_cfg(tmp_path, **tiny_training(tiny_model))
    cfg.training.device = "cpu"
    conf = tmp_path / "adapt.toml"
    conf.write_text(dump_toml(cfg))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(12, seed=3)))
    out = tmp_path / "ddp-cli"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen([sys.executable, "-m", "app", "train", "--gpus", "2", "--config", str(conf), "--data",
                             str(data), "--out", str(out), "--max-steps", "3", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("adapt train --gpus 2 did not finish in 300 s:\n" + stderr[-3000:])
    assert proc.returncode == 0, stderr[-5000:]
    answers = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    assert len(answers) == 1 and answers[0]["steps"] == 3 and answers[0]["out_dir"] == str(out)  # rank 0 only
    info = validate_head(out, tiny_model)
    assert info.manifest["training"]["world_size"] == 2
    # Several nodes: a c10d rendezvous every node names alike.
    argv = torchrun_argv(["--json"], 8, nnodes=2, rdzv_endpoint="node-0:29400", python="py")
    assert argv == ["py", "-m", "torch.distributed.run", "--nproc-per-node", "8", "--nnodes", "2", "--rdzv-backend",
                    "c10d", "--rdzv-endpoint", "node-0:29400", "--rdzv-id", "adapt-train", "-m", "app", "train",
                    "--json"]
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        torchrun_argv([], 2, nnodes=2)
