"""The training recipe: conversations in, a vLLM-loadable P-EAGLE head out.

Read top to bottom, :func:`train` is the whole recipe:

1. data    tokenize (chat template, assistant-only loss) + replay mix
2. model   warm start from a head (dir or ``models:/name/version``) or bootstrap
           from the target with a draft vocabulary picked by token frequency
           (:mod:`adapt.initial_head`)
3. target  aux hidden states + logits per example, computed once, kept in memory
           (:mod:`adapt.features`)
4. loop    AdamW, warmup + cosine (:mod:`adapt.schedule`), grad clip, fp32 master
           weights (bf16 autocast optional), checkpoint/resume (:mod:`adapt.run_state`),
           DDP under ``torchrun`` (:mod:`adapt.distributed`)
5. export  ``adapt.checkpoint.save_head`` with lineage in the manifest

Every random choice (batch order, depth down-sampling) is a pure function of
``(seed, step)``, so a resumed run replays exactly what an uninterrupted one does
(under a wall-time cap the learning rate also follows the clock, so only the
data and sampling replay exactly).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from adapt.checkpoint import save_head
from adapt.data import StepBatches, mix_replay, snapshot_id, tokenize_rows
from adapt.device import pick_device, use_bf16_autocast
from adapt.distributed import barrier, init_distributed, max_over_ranks, wrap_data_parallel
from adapt.features import TargetFeatures
from adapt.initial_head import ShapeChangeError, initial_head
from adapt.loss import collate, peagle_loss
from adapt.memory import heap_kept_between_steps
from adapt.run_state import RunState, load_run_state, run_fingerprint, save_run_state, trainable
from adapt.schedule import Schedule
from headspec.files import target_identity
from settings.config import Config

__all__ = ["ShapeChangeError", "TrainResult", "train"]


@dataclass
class TrainResult:
    out_dir: str
    steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    loss_curve: list[float]
    final_depth_loss: list[float]
    final_depth_acc: list[float]
    parent_sha: str | None
    data_snapshot: str
    num_examples: int
    featurize_seconds: float = 0.0
    acceptance: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def train(
    cfg: Config,
    conversations: Sequence[dict[str, Any]],
    base_head: str | None,
    out_dir: str | Path,
    replay_conversations: Sequence[dict[str, Any]] | None = None,
    *,
    target_dir: str | Path | None = None,
    run_dir: str | Path | None = None,
    progress: bool = True,
    after_export: Callable[[Path, Any], dict[str, Any]] | None = None,
    stop_after_steps: int | None = None,
) -> TrainResult:
    """Fine-tune (``base_head``) or bootstrap (None) a head on ``conversations``; export to ``out_dir``.

    ``run_dir`` (default: ``<out_dir>.run``) keeps the resumable checkpoint; a
    run with the same config, data and parent resumes from it. ``stop_after_steps``
    interrupts the loop early (after checkpointing) without counting as the end of
    the schedule, which is what resuming is for.
    """
    from transformers import AutoTokenizer

    from targets.model_zoo import ensure_target

    tc = cfg.training
    schedule = Schedule(tc)
    device = pick_device(tc.device)
    dd = init_distributed(device)
    torch.manual_seed(tc.seed)
    out_dir = Path(out_dir).absolute()
    run_dir = Path(run_dir) if run_dir else out_dir.with_name(out_dir.name + ".run")
    target_dir = Path(target_dir) if target_dir else ensure_target(cfg.target.model, cfg.target.model_cache)

    # 1. data
    tok = AutoTokenizer.from_pretrained(target_dir)
    rows = mix_replay(list(conversations), list(replay_conversations or []), tc.replay_ratio, tc.seed)
    examples = tokenize_rows(tok, rows, tc.max_seq_len)
    if not examples:
        raise ValueError("no conversation has assistant tokens to train on")
    snapshot = snapshot_id(examples)

    # 2. model
    start = initial_head(cfg, target_dir, base_head, examples, tok.eos_token_id)
    parent_sha, vocab_refresh = start.parent_sha, start.vocab_refresh
    model = start.model.to(device=device, dtype=torch.float32).train()
    K = model.config.num_speculative_tokens
    draft_ids = torch.arange(model.config.draft_vocab_size, device=model.d2t.device) + model.d2t

    # 3. target features (lazily, only for the examples this rank trains on)
    target = TargetFeatures(target_dir, model.config.aux_layer_ids, draft_ids.cpu(), device)

    # 4. loop
    opt = torch.optim.AdamW(list(trainable(model).values()), lr=tc.learning_rate, weight_decay=tc.weight_decay,
                            betas=(0.9, 0.95))
    fingerprint = run_fingerprint(cfg, parent_sha, snapshot)
    state = load_run_state(run_dir, model, opt, fingerprint) or RunState(fingerprint)
    ddp_model = wrap_data_parallel(model, device, dd)
    use_bf16 = use_bf16_autocast(tc.dtype, device)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext
    batches = StepBatches([len(e) for e in examples], tc.batch_tokens, tc.max_seq_len, tc.seed, dd.rank, dd.world)

    schedule.start()
    bar = None
    if progress and dd.main:
        from tqdm import tqdm

        bar = tqdm(total=tc.max_steps or None, initial=state.step, desc="train", unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    tokens_run = 0
    # CPU steps reuse their freed large blocks instead of faulting fresh pages in (see heap_kept_between_steps).
    with heap_kept_between_steps() if device.type == "cpu" else nullcontext():
        while state.step < schedule.max_steps:
            step = state.step
            # One value for all ranks: they must stop at the same step and use the same rate.
            used = max_over_ranks(schedule.time_used(), dd) if schedule.capped else 0.0
            if used >= 1.0:
                break
            if stop_after_steps is not None and step >= stop_after_steps:
                break
            feats = [[target.get(i, examples[i]) for i in row] for row in batches(step)]
            gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + step * 7919 + dd.rank)
            batch = collate(feats, K, model.config.ptd_token_id, tc.depth_keep, gen).to(device)
            batch.project_targets(target.output_rows)
            for g in opt.param_groups:
                g["lr"] = schedule.lr(step, used)
            with autocast():
                logits = ddp_model(**batch.model_inputs(), select=batch.valid)
            out = peagle_loss(logits, batch, model.d2t, tc.depth_weights, K)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            state.step += 1
            ntok = batch.num_tokens * dd.world
            tokens_run += ntok
            state.tokens += ntok
            state.loss_curve.append(round(float(out.loss.detach()), 6))
            state.depth_loss, state.depth_acc = out.depth_loss.tolist(), out.depth_acc.tolist()
            if bar is not None:
                el = time.perf_counter() - t_start
                bar.update(1)
                bar.set_postfix(loss=f"{float(out.loss.detach()):.3f}", acc1=f"{float(out.depth_acc[0]):.2f}",
                                tok_s=f"{tokens_run / max(el, 1e-9):.0f}")
            if state.step % tc.checkpoint_steps == 0 and dd.main:
                save_run_state(run_dir, model, opt,
                               replace(state, seconds=state.seconds + time.perf_counter() - t_start))
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    if dd.main:
        save_run_state(run_dir, model, opt, replace(state, seconds=state.seconds + elapsed))

    # 5. export
    acceptance = None
    if dd.main:
        manifest = {
            "parent": parent_sha,
            "data_snapshot": {"id": snapshot, "num_conversations": len(examples),
                              "content_hashes": sorted(e.content_hash for e in examples)},
            "config": {"training": tc.model_dump(mode="json"), "head": cfg.head.model_dump(mode="json")},
            "target": target_identity(target_dir),
            # From the state, so a resumed run that had already finished still reports them.
            "training": {"steps": state.step, "tokens": state.tokens, "final_depth_loss": state.depth_loss,
                         "final_depth_acc": state.depth_acc, "world_size": dd.world, "device": str(device),
                         "bf16_autocast": use_bf16},
            "draft_vocab_refresh": vocab_refresh,
        }
        save_head(model.cpu(), out_dir, manifest)
        if after_export is not None:
            # e.g. an offline acceptance estimate, reusing the target already loaded here
            acceptance = after_export(out_dir, target.runner)
    target.release()
    barrier(dd)
    return TrainResult(
        out_dir=str(out_dir), steps=state.step, tokens=state.tokens, seconds=round(elapsed, 3),
        tokens_per_s=round(tokens_run / max(elapsed, 1e-9), 1), loss_curve=state.loss_curve,
        final_depth_loss=state.depth_loss, final_depth_acc=state.depth_acc, parent_sha=parent_sha,
        data_snapshot=snapshot, num_examples=len(examples), featurize_seconds=round(target.seconds, 3),
        acceptance=acceptance, extra={"draft_vocab_refresh": vocab_refresh} if vocab_refresh else {},
    )
