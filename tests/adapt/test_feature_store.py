"""The target's features on disk across training runs (tiny target, CPU)."""

from __future__ import annotations

import os

import torch

from adapt.data import Example
from adapt.feature_store import FeatureStore, example_key
from adapt.features import TargetFeatures
from headspec.config import default_aux_layer_ids
from tests.example_support import examples

IDENTITY = {"target": "t" * 64, "aux_layer_ids": [1, 2, 3], "dtype": "torch.float32"}


def features(tiny_model, store: FeatureStore | None) -> TargetFeatures:
    return TargetFeatures(tiny_model, default_aux_layer_ids(4), torch.arange(64), torch.device("cpu"),
                          dtype=torch.float32, batch_tokens=160, store=store)


def test_a_later_run_reads_the_features_an_earlier_one_computed(tiny_model, tmp_path):
    """The second run's target featurizes only the examples the first did not see; the ones it reads back
    equal what was computed, tensor for tensor."""
    exs = examples(8)
    first = features(tiny_model, FeatureStore(tmp_path / "features", IDENTITY, 10**9))
    computed = first.get_many(list(range(5)), exs[:5])
    assert first.store.writes == 5 and first.store.hits == 0
    assert oct(os.stat(tmp_path / "features").st_mode & 0o777) == "0o700"  # user data: its owner's only
    later = features(tiny_model, FeatureStore(tmp_path / "features", IDENTITY, 10**9))
    calls: list[int] = []
    real = later.compute_many
    later.compute_many = lambda batch: calls.append(len(batch)) or real(batch)
    got = later.get_many(list(range(8)), exs)
    assert calls == [3] and later.store.hits == 5 and later.store.writes == 3
    for a, b in zip(computed, got[:5]):
        for name in ("input_ids", "aux_hidden", "target_argmax", "logit_rows", "target_hidden"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert torch.equal(a.loss_mask, b.loss_mask) and b.target_logits is None
    # single examples go through the store too
    one = features(tiny_model, FeatureStore(tmp_path / "features", IDENTITY, 10**9))
    assert torch.equal(one.get(0, exs[7]).aux_hidden, got[7].aux_hidden) and one.store.hits == 1


def test_another_target_precision_or_layout_never_reads_them(tiny_model, tmp_path):
    exs = examples(3)
    features(tiny_model, FeatureStore(tmp_path, IDENTITY, 10**9)).get_many([0, 1, 2], exs)
    for other in ({**IDENTITY, "dtype": "torch.bfloat16"}, {**IDENTITY, "target": "u" * 64},
                  {**IDENTITY, "aux_layer_ids": [0, 1, 2]}):
        store = FeatureStore(tmp_path, other, 10**9)
        assert [store.load(ex) for ex in exs] == [None] * 3 and store.misses == 3


def test_a_file_that_is_not_the_examples_is_not_used(tiny_model, tmp_path):
    """A stored file whose ids or mask differ from the example's (a foreign or damaged file under its name)
    is a miss: the target runs again."""
    exs = examples(2)
    store = FeatureStore(tmp_path, IDENTITY, 10**9)
    tf = features(tiny_model, store)
    tf.get_many([0, 1], exs)
    a, b = (store.dir / example_key(ex)[:2] / f"{example_key(ex)}.safetensors" for ex in exs)
    os.replace(b, a)  # example 1's features under example 0's name
    assert store.load(exs[0]) is None and store.load(exs[1]) is None
    a.write_bytes(b"not safetensors")
    assert store.load(exs[0]) is None
    other = Example(exs[0].input_ids, ~exs[0].loss_mask, "same ids, other mask")
    assert example_key(other) != example_key(exs[0])


def test_the_store_stays_within_its_budget_dropping_the_least_recently_used(tiny_model, tmp_path):
    exs = examples(10, seed=3)
    big = FeatureStore(tmp_path / "big", IDENTITY, 10**9)
    features(tiny_model, big).get_many(list(range(10)), exs)
    per_file = big.used / 10
    store = FeatureStore(tmp_path / "small", IDENTITY, int(per_file * 4.5))
    tf = features(tiny_model, store)
    tf.get_many([0, 1, 2], exs[:3])
    old = store._path(example_key(exs[0]))
    os.utime(old, ns=(1, 1))  # example 0 unused for long
    assert store.load(exs[1]) is not None  # read: recently used
    tf.get_many(list(range(3, 8)), exs[3:8])
    files = list(store.dir.glob("*/*.safetensors"))
    assert store.evicted > 0 and store.used <= store.max_bytes and sum(f.stat().st_size for f in files) == store.used
    assert not old.exists() and store._path(example_key(exs[7])).exists()
    off = FeatureStore(tmp_path / "off", IDENTITY, 0)
    features(tiny_model, off).get_many([0], exs[:1])
    assert off.writes == 0 and not list(off.dir.glob("*/*.safetensors"))
