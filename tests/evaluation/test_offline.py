"""The offline acceptance estimator (adapt/evaluate.py) against references built step by step.

No target model: the drafter only sees token ids and aux hidden states, so a
random head on random inputs exercises every slot and mask rule.
"""

from __future__ import annotations

import pytest
import torch

from adapt.drafter import PEagleDrafter, build_draft_inputs
from evaluation.offline import all_step_inputs, simulate
from headspec.config import DrafterConfig

K = 4
N = 14  # sequence length
START, END = 3, 12  # steps m in [START, END)


@pytest.fixture(scope="module")
def sharp():
    """A random fp32 head whose attention is far from uniform, so every visible slot moves its logits."""
    cfg = DrafterConfig(hidden_size=64, target_hidden_size=32, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=100, draft_vocab_size=60,
                        aux_layer_ids=[1, 2, 3], ptd_token_id=99, num_speculative_tokens=K)
    torch.manual_seed(0)
    model = PEagleDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ("mask_hidden", "mask_embedding"):
                p.normal_()
            elif p.dim() == 2:
                p.normal_(0, 1.5 / p.shape[1] ** 0.5)
    model.set_draft_vocab(torch.randperm(100)[:60])
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 99, (N,), generator=g)
    aux = torch.randn(N, cfg.fc_input_size, generator=g)
    return model.eval(), seq, aux


def _reference_mask(C: int) -> torch.Tensor:
    """all_step_inputs' attention mask written out slot by slot from vLLM's per-step layout."""
    n = C + (END - START) * (K - 1)
    ref = torch.zeros(n, n, dtype=torch.bool)
    for i in range(C):
        for j in range(i + 1):
            ref[i, j] = True  # context slots are causal
    for s, m in enumerate(range(START, END)):
        for o in range(K - 1):
            row = C + s * (K - 1) + o
            # vLLM gives step m the context seq[:m+1], i.e. context slots 0..m-1 ...
            for j in range(m):
                ref[row, j] = True
            # ... and its own earlier mask slots.
            for o2 in range(o + 1):
                ref[row, C + s * (K - 1) + o2] = True
    return ref


def _mask_slots_see_one_more_slot(allow: torch.Tensor, C: int) -> torch.Tensor:
    """The mask with each step's mask slots also seeing context slot m (the token they should predict)."""
    wrong = allow.clone()
    steps = torch.arange(START, END).repeat_interleave(K - 1)
    wrong[C:, :C] = torch.arange(C)[None] <= steps[:, None]
    return wrong


def test_all_step_mask_matches_the_per_step_layout(sharp):
    model, seq, aux = sharp
    kwargs, sample = all_step_inputs(model.config, seq, aux, START, END)
    C = N - 1
    assert torch.equal(kwargs["attn_mask"][0], _reference_mask(C))
    assert sample.shape == (END - START, K)
    assert torch.equal(sample[:, 0], torch.arange(START - 1, END - 1))  # the bonus slot m-1 drafts token 1


@torch.no_grad()
def test_all_step_drafts_equal_drafts_from_only_what_vllm_gives_each_step(sharp):
    """Step m run alone on seq[:m+1] and aux[:m] (vLLM's per-step pass) gives the all-step pass's logits."""
    model, seq, aux = sharp
    kwargs, sample = all_step_inputs(model.config, seq, aux, START, END)
    fast = model(**kwargs)[0][sample]  # [S, K, draft_vocab]
    for s, m in enumerate(range(START, END)):
        seen_seq, seen_aux = seq[:m + 1].clone(), aux[:m].clone()
        inp = build_draft_inputs(seen_seq[:m], seen_aux, int(seen_seq[m]), model.config)
        idx = inp.pop("sample_index")
        slow = model(**inp)[0, idx]
        torch.testing.assert_close(fast[s], slow, rtol=1e-4, atol=1e-4, msg=f"step m={m}")
        assert torch.equal(fast[s].argmax(-1), slow.argmax(-1)), f"step m={m}"

    # The comparison has teeth: letting mask slots see one slot further (the token
    # they should predict) changes this head's drafts.
    C = N - 1
    leaky = dict(kwargs, attn_mask=_mask_slots_see_one_more_slot(kwargs["attn_mask"][0], C)[None])
    leaked = model(**leaky)[0][sample]
    assert (leaked[:, 1:] - fast[:, 1:]).abs().max() > 0.1
    assert not torch.equal(leaked[:, 1:].argmax(-1), fast[:, 1:].argmax(-1))


def test_simulate_stops_at_the_first_wrong_draft():
    """Drafts that match after a mismatch are not accepted (vLLM accepts the longest matching prefix)."""
    seq = [1, 2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    prompt_len, k = 2, 3
    # Every row the walk should not visit drafts the true continuation, so visiting one changes the counts.
    drafts = torch.tensor([seq[m + 1:m + 1 + k] for m in range(prompt_len, len(seq) - k)])
    drafts[0] = torch.tensor([99, 12, 13])  # m=2 (sampled 10): wrong first, right 2nd and 3rd -> 0 accepted, m=3
    drafts[1] = torch.tensor([12, 99, 14])  # m=3 (sampled 11): right, wrong, right -> 1 accepted, m=5
    # m=5 (sampled 13): the true continuation 14 15 16 -> 3 accepted, m=9, 8 tokens generated: stop.
    c = simulate(seq, drafts, prompt_len=prompt_len, max_new_tokens=8)
    assert c == {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 4, "accepted_per_pos": [2, 1, 1]}


def test_heads_compared_on_shared_sequences_count_as_each_alone(tiny_model, tmp_path):
    """compare_heads computes the target's answers once; each head's figures equal its own estimate."""
    from adapt.checkpoint import init_random_head
    from evaluation.offline import compare_heads, estimate_acceptance

    heads = {role: init_random_head(tiny_model, tmp_path / role, k=3, seed=i, draft_vocab_size=256)
             for i, role in enumerate(("candidate", "live"))}
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"tell me about the number {i}"},
                                              {"from": "gpt", "value": "ok"}]} for i in range(5)]
    both = compare_heads(heads, tiny_model, rows, max_new_tokens=12, device="cpu", batch_size=1)
    for role, head in heads.items():
        alone = estimate_acceptance(head, tiny_model, rows, max_new_tokens=12, device="cpu")
        assert both[role]["per_prompt"] == alone["per_prompt"] and len(alone["per_prompt"]) == 5
        assert both[role]["mean_acceptance_length"] == alone["mean_acceptance_length"]
        assert sum(d for d, _ in alone["per_prompt"]) == alone["num_drafts"]


def test_the_evaluate_step_loads_the_target_in_bf16_across_every_gpu_and_in_fp32_on_a_cpu(monkeypatch):
    """A target that fits only on all of a worker's GPUs together is evaluated: bf16 (the dtype it is served
    in) spread by device_map over every visible GPU; one GPU holds it whole; a CPU keeps fp32 unless it
    multiplies bf16 natively (where its replicas serve bf16)."""
    import torch

    from adapt import device
    from evaluation.offline import target_placement

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert target_placement("cpu") == (torch.float32, None)
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert target_placement("cpu") == (torch.bfloat16, None)
    assert target_placement("cuda", gpus=4) == (torch.bfloat16, "auto")
    assert target_placement("cuda", gpus=1) == (torch.bfloat16, None)


def _served_rows(tiny_model, n: int, answer_tokens: int) -> list[dict]:
    """Greedy requests as the router captures them: messages, temperature 0, the prompt and answer ids."""
    from adapt.hidden_states import TargetRunner

    runner = TargetRunner(tiny_model, [1], device="cpu", dtype=torch.float32)
    rows = []
    for i in range(n):
        conv = [{"from": "human", "value": f"tell me about the number {i}"}]
        prompt = runner.prompt_ids({"conversations": conv})
        answer = runner.greedy(prompt, answer_tokens)
        text = runner.tokenizer.decode(answer, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        rows.append({"id": f"c{i}", "conversations": conv + [{"from": "gpt", "value": text}], "temperature": 0.0,
                     "prompt_token_ids": prompt, "output_token_ids": answer, "finish_reason": "length"})
    return rows


def test_a_greedy_request_s_served_answer_is_the_continuation_and_is_not_generated_again(tiny_model, tmp_path,
                                                                                        monkeypatch):
    """Where the capture holds a greedy request's ids, the evaluation drafts on the served answer (the target's
    own greedy continuation) and counts as if the target had answered again; a sampled request, or one
    without ids, is answered again."""
    from adapt.checkpoint import init_random_head
    from adapt.hidden_states import TargetRunner
    from evaluation.offline import compare_heads

    heads = {role: init_random_head(tiny_model, tmp_path / role, k=3, seed=i, draft_vocab_size=256)
             for i, role in enumerate(("candidate", "live"))}
    rows = _served_rows(tiny_model, 4, 15)
    without_ids = [{k: v for k, v in r.items() if not k.endswith("token_ids")} for r in rows]
    plain = compare_heads(heads, tiny_model, without_ids, max_new_tokens=12, device="cpu", batch_size=2)
    calls = []
    real = TargetRunner.greedy_batch
    monkeypatch.setattr(TargetRunner, "greedy_batch", lambda self, *a: calls.append(a) or real(self, *a))
    served = compare_heads(heads, tiny_model, rows, max_new_tokens=12, device="cpu", batch_size=2)
    assert calls == []
    for role in heads:
        assert served[role]["answers"] == {"served": 4, "generated": 0}
        assert plain[role]["answers"] == {"served": 0, "generated": 4}
        assert served[role]["per_prompt"] == plain[role]["per_prompt"]
        assert served[role]["num_drafts"] > 0
    sampled = compare_heads(heads, tiny_model, [{**r, "temperature": 0.7} for r in rows], max_new_tokens=12,
                            device="cpu", batch_size=2)
    assert sampled["live"]["answers"] == {"served": 0, "generated": 4} and len(calls) == 2


def test_a_served_answer_shorter_than_the_budget_ends_the_walk(tiny_model, tmp_path):
    """An answer that stopped before the budget is walked to its end, never past it (no crash, no drafts
    counted beyond what the request produced)."""
    from adapt.checkpoint import init_random_head
    from evaluation.offline import compare_heads

    head = init_random_head(tiny_model, tmp_path / "h", k=3, draft_vocab_size=256)
    rows = [{**r, "finish_reason": "stop"} for r in _served_rows(tiny_model, 3, 5)]
    out = compare_heads({"candidate": head, "live": head}, tiny_model, rows, max_new_tokens=12, device="cpu")
    assert out["live"]["answers"]["served"] == 3
    for drafts, accepted in out["live"]["per_prompt"]:
        assert 1 <= drafts <= 4 and accepted <= 3 * drafts
    assert out["live"]["num_generated_tokens"] == 15


def test_prompts_are_answered_in_length_sorted_batches_within_a_token_cap(tiny_model, monkeypatch):
    """Left padding costs every prompt of a batch the longest one's length: batches hold prompts of similar
    length, at most ``batch_tokens`` padded tokens each, and the sequences come back in the prompts' order,
    the same as answered one by one."""
    from adapt.hidden_states import TargetRunner
    from evaluation.offline import prepare_sequences

    runner = TargetRunner(tiny_model, [1], device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    prompts = [torch.randint(10, 200, (n,)).tolist() for n in (40, 5, 33, 6, 38, 7, 4, 35)]
    seen = []
    real = TargetRunner.greedy_batch
    monkeypatch.setattr(TargetRunner, "greedy_batch", lambda self, ps, *a: seen.append([len(p) for p in ps])
                        or real(self, ps, *a))
    alone = prepare_sequences(runner, prompts, 6, 2, batch_size=1)
    batched = prepare_sequences(runner, prompts, 6, 2, batch_size=4, batch_tokens=100)
    assert [s.seq for s in batched] == [s.seq for s in alone]
    assert [s.prompt_len for s in batched] == [len(p) for p in prompts]
    assert seen == [[4, 5, 6, 7], [33, 35], [38, 40]]  # 4 x (7 + 8) <= 100; 2 x (40 + 8) <= 100 < 3 x 48
