"""In-vLLM proof: a head trained by ``adapt.train`` on the target's own traffic is
accepted clearly more often than the untrained head, and speculative decoding
leaves the greedy text unchanged.

Traffic: chat prompts answered greedily by the tiny target itself, logged as
ShareGPT text (as the endpoint capture would). Training is bounded in steps and
minutes. Measured on held-out prompts through vLLM's own spec-decode counters.
Both heads are served by the session's float32 engine, the trained one swapped in place (see
tests/adapt/test_head_vllm.py: the random tiny target has near-tied logits, so bf16 batching
noise could flip a greedy token and make a text comparison meaningless).
"""

from __future__ import annotations

import time

import pytest
import torch

from adapt.hidden_states import TargetRunner
from adapt.train import train
from evaluation.offline import estimate_acceptance
from settings.config import load_config
from tests.target_support import self_answered, serve_greedy, served_head

K = 3
MAX_NEW = 40


@pytest.fixture(scope="module")
def adapted(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("train-vllm")
    cfg = load_config(None, {
        "state_dir": str(work / "state"), "target": {"model": str(tiny_model)}, "head": {"draft_vocab_size": 256},
        "training": {"max_steps": 150, "max_minutes": 2.0, "batch_tokens": 1024, "max_seq_len": 256,
                     "warmup_steps": 5, "learning_rate": 3e-3},
    })
    # Shared cores: spinning OpenMP threads slow generation and training several-fold.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = TargetRunner(tiny_model, [1, 2, 3], device="cpu", dtype=torch.float32)
        rows = self_answered(runner, 48, seed=0)
        held = [runner.prompt_ids(r) for r in self_answered(runner, 6, seed=1)]
        res = train(cfg, rows, None, work / "head", progress=False)
    finally:
        torch.set_num_threads(before)
    return work / "head", runner, held, res


def _serve_and_count(server, prompts: list[list[int]]) -> tuple[list[list[int]], float, list[float]]:
    outs, d = serve_greedy(server, prompts, MAX_NEW)
    drafts, acc = d.drafts, d.accepted
    per_pos = [x / drafts for x in d.per_pos]
    assert drafts > 0
    return outs, 1 + acc / drafts, per_pos


def test_trained_head_beats_untrained_in_vllm_with_identical_text(adapted, vllm_server):
    head, runner, held, res = adapted
    assert res.steps > 20 and res.loss_curve[-1] < res.loss_curve[0]
    # Untrained head: the session's server (random head, K=3); then the trained head swapped in.
    _, base_mal, base_pos = _serve_and_count(vllm_server, held)
    t0 = time.monotonic()
    with served_head(vllm_server, head) as server:
        outs, mal, pos = _serve_and_count(server, held)
    off = estimate_acceptance(head, runner.target_dir, prompts_ids=held, max_new_tokens=MAX_NEW,
                              ignore_eos=True, runner=runner)
    print(f"\ntrain: {res.steps} steps, {res.tokens_per_s:.0f} tok/s; untrained MAL {base_mal:.3f} {base_pos}; "
          f"trained MAL {mal:.3f} {pos} (offline {off['mean_acceptance_length']:.3f}); "
          f"swap and serve {time.monotonic() - t0:.0f}s")
    # Greedy spec decoding must reproduce the target's own greedy text (no-spec reference).
    for p, got in zip(held, outs):
        assert got == runner.greedy(p, MAX_NEW)
    assert mal >= base_mal + 0.08, (mal, base_mal)
    assert pos[0] > base_pos[0]
