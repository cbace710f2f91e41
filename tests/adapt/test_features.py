"""Batched featurization and the target's placement, against one forward per example (tiny target, CPU)."""

from __future__ import annotations

import pytest
import torch

from headspec.config import default_aux_layer_ids
from tests.example_support import examples


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_featurization_equals_one_forward_per_example(tiny_model, dtype):
    """Right-padded buckets with an attention mask give each example its own states: aux hidden states and
    final hidden states equal the per-example forward's up to rounding, the target's argmax agrees."""
    from adapt.features import TargetFeatures

    tf = TargetFeatures(tiny_model, default_aux_layer_ids(4), torch.arange(64), torch.device("cpu"), dtype=dtype,
                        batch_tokens=160)
    exs = examples(8)
    many = tf.compute_many(exs)
    # Both are kept in bf16: an fp32 target's states differ by a bf16 rounding at most.
    tol = 2 ** -8 if dtype == torch.float32 else 2e-2
    agree = rows = 0
    for ex, got in zip(exs, many):
        want = tf.compute(ex)
        assert torch.equal(got.input_ids, ex.input_ids) and torch.equal(got.logit_rows, want.logit_rows)
        assert got.aux_hidden.dtype == torch.bfloat16 and got.aux_hidden.shape == want.aux_hidden.shape
        for a, b in ((got.aux_hidden, want.aux_hidden), (got.target_hidden, want.target_hidden)):
            err = (a.float() - b.float()).abs().max() / b.float().abs().max()
            assert err <= tol, err
        assert got.aux_hidden.untyped_storage().nbytes() == got.aux_hidden.nbytes  # not a view of the padded batch
        r = want.logit_rows
        agree += int((got.target_argmax[r] == want.target_argmax[r]).sum())
        rows += r.numel()
        assert bool((got.target_argmax[r] >= 0).all()) and int((got.target_argmax >= 0).sum()) == r.numel()
    assert agree / rows >= (1.0 if dtype == torch.float32 else 0.97)
    if dtype == torch.float32:  # before the bf16 storage: the same states
        ids = torch.zeros(2, 40, dtype=torch.long)
        ids[0, :23], ids[1] = torch.arange(100, 123), torch.arange(4, 44)
        attn = torch.zeros(2, 40, dtype=torch.long)
        attn[0, :23], attn[1] = 1, 1
        aux, final = tf.runner.forward_batch(ids, attn)
        for b, n in ((0, 23), (1, 40)):
            one, _ = tf.runner.forward(ids[b, :n], with_logits=False)
            torch.testing.assert_close(aux[b, :n], one, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(final[b, :n], tf.runner.final_hidden(), rtol=1e-5, atol=1e-5)
    # get_many keeps what it computed and featurizes only what is missing.
    first = tf.get_many([0, 1, 2], exs[:3])
    before = tf.seconds
    again = tf.get_many([2, 1, 0, 3], [exs[2], exs[1], exs[0], exs[3]])
    assert again[0] is first[2] and again[2] is first[0] and tf.seconds > before and sorted(tf.cache) == [0, 1, 2, 3]


def test_aux_states_captured_at_layer_inputs_are_transformers_hidden_states(tiny_model):
    from transformers import AutoModelForCausalLM

    from adapt.hidden_states import TargetRunner

    runner = TargetRunner(tiny_model, [0, 2, 4], device="cpu", dtype=torch.float32)
    ids = torch.tensor([5, 17, 99, 3, 250, 42, 7])
    aux, _ = runner.forward(ids, with_logits=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states
        pre = model.model.norm.weight  # layer 4 of 4 is the pre-norm output, before the final norm
    want_last = aux[:, -128:]
    normed = want_last * torch.rsqrt(want_last.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps) * pre
    torch.testing.assert_close(torch.cat([hs[0][0], hs[2][0]], -1), aux[:, :256], rtol=0, atol=0)
    torch.testing.assert_close(normed, hs[4][0], rtol=1e-5, atol=1e-5)


def test_the_target_spreads_over_gpus_only_in_a_single_process_run_that_sees_several(tiny_model, monkeypatch):
    from adapt.device import target_device_map
    from adapt.hidden_states import TargetRunner

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert target_device_map(cuda, world=1, gpus=4) == "auto"
    assert target_device_map(cuda, world=1, gpus=1) is None  # one GPU: the whole target on it, as before
    assert target_device_map(cuda, world=2, gpus=4) is None  # torchrun: each rank owns its GPU
    assert target_device_map(cpu, world=1, gpus=4) is None
    # A placement map is honoured and changes nothing in what comes out (here: every module on the CPU).
    plain = TargetRunner(tiny_model, default_aux_layer_ids(4), device="cpu", dtype=torch.float32)
    placed = TargetRunner(tiny_model, default_aux_layer_ids(4), device="cpu", dtype=torch.float32,
                          device_map={"": "cpu"})
    assert placed.device_map == {"": "cpu"} and plain.device_map is None
    ids = torch.tensor([5, 17, 99, 3, 250])
    a, la = plain.forward(ids)
    b, lb = placed.forward(ids)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert torch.equal(plain.final_hidden(), placed.final_hidden())
