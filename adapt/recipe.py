"""The training recipe: conversations in, a vLLM-loadable P-EAGLE head out.

:class:`TrainRecipe` runs in four phases over small components:

``setup``    the data (chat template, assistant-only loss, replay mix), the
             starting head (:mod:`adapt.initial_head`: warm start or bootstrap),
             the target's features (:mod:`adapt.features`), AdamW, the resumable
             state (:mod:`adapt.run_state`) and DDP under ``torchrun``
             (:mod:`adapt.distributed`)
``train``    the loop: the attention backend (:mod:`adapt.attention`, measured
             on the first batch under ``auto``), warmup + cosine within step and
             wall-time bounds (:mod:`adapt.schedule`), grad clip, fp32 master
             weights (bf16 autocast optional), a checkpoint every ``checkpoint_steps``
``save``     the head with its lineage in the manifest (``adapt.checkpoint.save_head``)
``cleanup``  the feature cache released, the ranks joined

Every random choice (batch order, depth down-sampling) is a pure function of
``(seed, step)``, so a resumed run replays exactly what an uninterrupted one does
(under a wall-time cap the learning rate also follows the clock, so only the
data and sampling replay exactly). A resumed run keeps the attention backend its
first session picked, so its arithmetic is the same too.

Nothing in a step waits for the device: batches are planned on the host and
gathered on the device, and losses are read back in one transfer per logging
interval (:meth:`TrainRecipe._flush`), not per step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from adapt.attention import SHAPES, Pick, candidates, pick_backend, unavailable_reason
from adapt.checkpoint import save_head
from adapt.data import StepBatches, TokenizeReport, mix_replay, newest_time, snapshot_id, tokenize_rows
from adapt.device import cpu_model, pick_device, target_device_map, use_bf16_autocast
from adapt.distributed import (barrier, broadcast_from_main, init_distributed, max_over_ranks, teardown_distributed,
                               wrap_data_parallel)
from adapt.feature_store import FeatureStore
from adapt.features import TargetFeatures
from adapt.hidden_states import TargetRunner
from adapt.initial_head import initial_head
from adapt.loss import Batch, Features, LossOutput, collate, peagle_loss
from adapt.memory import heap_kept_between_steps
from adapt.run_state import RunState, load_run_state, run_fingerprint, save_run_state, trainable
from adapt.schedule import Schedule
from headspec.files import target_identity
from settings.config import Config
from targets.model_zoo import ensure_target

# Called on rank 0 with the exported head and the target already loaded (e.g. an offline acceptance estimate).
AfterExport = Callable[[Path, TargetRunner], dict[str, Any]]
# Losses are read back from the device at most this often (seconds), or after this many steps.
FLUSH_SECONDS, FLUSH_STEPS = 1.0, 200


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


class TrainRecipe:
    """Fine-tune (warm start) or bootstrap a head; ``setup`` → ``train`` → ``save`` → ``cleanup``, then ``result()``.

    The arguments are :func:`adapt.train.train`'s, which runs the phases in that order.
    """

    def __init__(self, cfg: Config, out_dir: str | Path, *, target_dir: str | Path | None = None,
                 run_dir: str | Path | None = None, progress: bool = True,
                 stop_after_steps: int | None = None) -> None:
        self.cfg, self.tc = cfg, cfg.training
        self.schedule = Schedule(cfg.training)  # first: a run without a bound fails before loading anything
        self.out_dir = Path(out_dir).absolute()
        self.run_dir = Path(run_dir) if run_dir else self.out_dir.with_name(self.out_dir.name + ".run")
        self.target_dir = Path(target_dir) if target_dir else None
        self.progress, self.stop_after_steps = progress, stop_after_steps
        self.features: TargetFeatures | None = None
        self.acceptance: dict[str, Any] | None = None
        self.tokenize_report = TokenizeReport()
        self.data_until: str | None = None  # the newest capture time among the rows trained on
        self.tokens_run, self.seconds = 0, 0.0  # this session's, not the resumed run's
        self._finished = False
        self.attention: Pick | None = None
        self._pending: list[LossOutput] = []
        self._flushed_at = 0.0

    # --- setup ---------------------------------------------------------------------

    def setup(self, conversations: Sequence[dict[str, Any]], base_head: str | None = None,
              replay_conversations: Sequence[dict[str, Any]] | None = None) -> None:
        """The device and ranks, the examples, the initial head, the target's features, AdamW (resumed) and batches."""
        tc = self.tc
        self.device = pick_device(tc.device)
        if tc.attention != "auto" and (why := unavailable_reason(tc.attention, self.device)):
            raise ValueError(f"[training] attention = {tc.attention!r}: {why}")
        self.dist = init_distributed(self.device)
        torch.manual_seed(tc.seed)
        if self.target_dir is None:
            self.target_dir = ensure_target(self.cfg.target.model, self.cfg.target.model_cache)
        eos_id = self._setup_data(conversations, replay_conversations)
        start = initial_head(self.cfg, self.target_dir, base_head, self.examples, eos_id)
        self.parent_sha, self.vocab_refresh = start.parent_sha, start.vocab_refresh
        self.model = start.model.to(device=self.device, dtype=torch.float32).train()
        self.bf16 = use_bf16_autocast(tc.dtype, self.device)
        # Features are computed lazily, only for the examples this rank trains on, by the
        # target in the step's precision (emulated bf16 would run it several times slower).
        draft_ids = torch.arange(self.model.config.draft_vocab_size, device=self.model.d2t.device) + self.model.d2t
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.features = TargetFeatures(self.target_dir, self.model.config.aux_layer_ids, draft_ids.cpu(), self.device,
                                       dtype=dtype, device_map=target_device_map(self.device, self.dist.world),
                                       store=self._feature_store(dtype))
        self._setup_optimizer()
        self.batches = StepBatches([len(e) for e in self.examples], tc.batch_tokens, tc.max_seq_len, tc.seed,
                                   self.dist.rank, self.dist.world)

    def _feature_store(self, dtype: torch.dtype) -> FeatureStore | None:
        """The deployment's store of the target's features, where training runs on a CPU (``[training]
        feature_store_gb``): the examples earlier runs featurized are read back instead of run again."""
        gb = self.tc.feature_store_gb
        if gb <= 0 or self.device.type != "cpu":
            return None
        identity = {"target": target_identity(self.target_dir)["weights_sha256"],
                    "aux_layer_ids": list(self.model.config.aux_layer_ids), "dtype": str(dtype)}
        return FeatureStore(Path(self.cfg.state_dir) / "features", identity, int(gb * 1e9))

    def _setup_data(self, conversations: Sequence[dict[str, Any]],
                    replay: Sequence[dict[str, Any]] | None) -> int | None:
        """Tokenized examples (new + replayed) and their snapshot id; returns the end-of-turn token id."""
        from transformers import AutoTokenizer  # heavy: only once a run starts

        tc = self.tc
        tok = AutoTokenizer.from_pretrained(self.target_dir)
        rows = mix_replay(list(conversations), list(replay or []), tc.replay_ratio, tc.seed)
        # A row that cannot be rendered as the target processed it is skipped and counted, never fatal.
        self.tokenize_report = TokenizeReport()
        self.data_until = newest_time(rows)  # a fine-tune of this head trains on what came after as new
        self.examples = tokenize_rows(tok, rows, tc.max_seq_len, self.tokenize_report)
        if not self.examples:
            raise ValueError(f"no conversation has assistant tokens to train on ({self.tokenize_report.to_dict()})")
        self.snapshot = snapshot_id(self.examples)
        return tok.eos_token_id

    def _setup_optimizer(self) -> None:
        """AdamW over the trainable weights, resumed from ``run_dir`` when it holds this run; DDP when launched so."""
        tc = self.tc
        # Fused on CUDA: one kernel for every parameter instead of a launch per tensor and op.
        self.opt = torch.optim.AdamW(list(trainable(self.model).values()), lr=tc.learning_rate,
                                     weight_decay=tc.weight_decay, betas=(0.9, 0.95),
                                     fused=True if self.device.type == "cuda" else None)
        fingerprint = run_fingerprint(self.cfg, self.parent_sha, self.snapshot)
        self.state = load_run_state(self.run_dir, self.model, self.opt, fingerprint) or RunState(fingerprint)
        self.ddp_model = wrap_data_parallel(self.model, self.device, self.dist)

    # --- train ---------------------------------------------------------------------

    def train(self) -> None:
        """Steps until ``max_steps``, the wall-time cap or ``stop_after_steps``; checkpoints along the way and at the end."""
        st, schedule = self.state, self.schedule
        bar = self._progress_bar()
        if st.step < schedule.max_steps:
            self.attention = self._pick_attention(st.step)
        # After the pick: like loading, measuring the backends (and compiling them) is not training time.
        schedule.start()
        t_start = self._flushed_at = time.perf_counter()
        # CPU steps reuse their freed large blocks instead of faulting fresh pages in.
        with heap_kept_between_steps() if self.device.type == "cpu" else nullcontext():
            while st.step < schedule.max_steps:
                # One value for all ranks: they must stop at the same step and use the same rate.
                used = max_over_ranks(schedule.time_used(), self.dist) if schedule.capped else 0.0
                if used >= 1.0 or (self.stop_after_steps is not None and st.step >= self.stop_after_steps):
                    break
                out, ntok = self._step(st.step, used)
                self._record(out, ntok, bar, time.perf_counter() - t_start)
                if st.step % self.tc.checkpoint_steps == 0 and self.dist.main:
                    self._flush(bar, time.perf_counter() - t_start)
                    self._checkpoint(time.perf_counter() - t_start)
        self._flush(bar, time.perf_counter() - t_start)
        if bar is not None:
            bar.close()
        self.seconds = time.perf_counter() - t_start
        if self.dist.main:
            self._checkpoint(self.seconds)

    def _features(self, step: int) -> list[list[Features]]:
        """This rank's rows of examples at ``step``, featurized (those not cached, in batches of the target)."""
        rows = self.batches(step)
        flat = self.features.get_many([i for row in rows for i in row], [self.examples[i] for row in rows for i in row])
        out, at = [], 0
        for row in rows:
            out.append(flat[at:at + len(row)])
            at += len(row)
        return out

    def _batch(self, feats: list[list[Features]], step: int, backend: str) -> Batch:
        """The step's drafter batch laid out for ``backend``; depth sampling is a function of ``(seed, step, rank)``."""
        model, tc = self.model, self.tc
        gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + step * 7919 + self.dist.rank)
        shape = SHAPES[backend]
        # On the step's device already; the aux states stay in the features' bf16 (the head's fc casts them).
        batch = collate(feats, model.config.num_speculative_tokens, model.config.ptd_token_id, tc.depth_keep, gen,
                        flat=shape.flat, pad_multiple=shape.pad_multiple, device=self.device)
        batch.project_targets(self.features.output_rows)
        return batch

    def _loss(self, model: torch.nn.Module, batch: Batch, backend: str) -> LossOutput:
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext():
            logits = model(**batch.drafter_inputs(), attention=batch.attention(backend), select=batch.valid_index)
        return peagle_loss(logits, batch, self.model.d2t, self.tc.depth_weights, self.model.config.num_speculative_tokens)

    def _pick_attention(self, step: int) -> Pick:
        """The attention backend: as configured, as the resumed run had it, or (``auto``) the fastest here,
        timed on this run's first batches (forward + backward, no update) and decided by rank 0 for all ranks."""
        tc = self.tc
        if tc.attention != "auto":
            return Pick(tc.attention, how="configured")
        if self.state.attention:
            return Pick(self.state.attention, how="resumed")
        pick = None
        if self.dist.main:
            cuda = self.device.type == "cuda"
            warmups, reps = (3, 3) if cuda else (1, 3)
            # On CUDA, distinct batches, the ones training starts with (featurized now, kept in the cache
            # for it): compiled kernels and per-shape plans pay for new shapes, as training's batches do.
            # A CPU backend builds nothing per shape, and featurizing more batches before the
            # wall-time cap starts would only lengthen the run, so one batch is timed there.
            feats = [self._features(step + i) for i in range(warmups + reps if cuda else 1)]
            c = self.model.config
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else cpu_model()
            key = (name, torch.__version__, torch.get_num_threads(), c.hidden_size, c.num_attention_heads,
                   c.num_key_value_heads, c.head_dim, c.num_layers, c.num_speculative_tokens, tc.batch_tokens,
                   tc.max_seq_len, tuple(tc.depth_keep), self.bf16)

            def run(backend: str, i: int) -> None:
                # The bare model, not DDP's: no gradient exchange while the ranks are not in step.
                j = i % len(feats)
                self._loss(self.model, self._batch(feats[j], step + j, backend), backend).loss.backward()
                self.opt.zero_grad(set_to_none=True)

            sync = torch.cuda.synchronize if cuda else (lambda: None)
            pick = pick_backend(candidates(self.device), run, sync, key, reps=reps, warmups=warmups,
                                store=Path(self.cfg.cache_dir) / "attention-picks.json")
        pick = broadcast_from_main(pick, self.dist)
        self.state.attention = pick.backend
        return pick

    def _step(self, step: int, time_used: float) -> tuple[LossOutput, int]:
        """One optimizer step on this rank's batch; returns its loss and the tokens all ranks trained on."""
        backend = self.attention.backend
        batch = self._batch(self._features(step), step, backend)
        for g in self.opt.param_groups:
            g["lr"] = self.schedule.lr(step, time_used)
        out = self._loss(self.ddp_model, batch, backend)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if self.tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        self.opt.step()
        return out, batch.num_tokens * self.dist.world

    def _record(self, out: LossOutput, ntok: int, bar: Any, elapsed: float) -> None:
        """Count the step; its loss stays on the device until the next :meth:`_flush`."""
        st = self.state
        st.step += 1
        st.tokens += ntok
        self.tokens_run += ntok
        self._pending.append(out)
        if bar is not None:
            bar.update(1)
        if len(self._pending) >= FLUSH_STEPS or time.perf_counter() - self._flushed_at >= FLUSH_SECONDS:
            self._flush(bar, elapsed)

    def _flush(self, bar: Any, elapsed: float) -> None:
        """Read the pending steps' losses back in one transfer: the loss curve, the last step's per-depth figures."""
        if not self._pending:
            return
        st, last = self.state, self._pending[-1]
        losses = torch.stack([o.loss.detach() for o in self._pending]).tolist()
        st.loss_curve.extend(round(x, 6) for x in losses)
        st.depth_loss, st.depth_acc = last.depth_loss.tolist(), last.depth_acc.tolist()
        self._pending.clear()
        self._flushed_at = time.perf_counter()
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc1=f"{st.depth_acc[0]:.2f}",
                            tok_s=f"{self.tokens_run / max(elapsed, 1e-9):.0f}")

    def _checkpoint(self, elapsed: float) -> None:
        """The resumable state with this session's ``elapsed`` seconds added to the earlier sessions'."""
        save_run_state(self.run_dir, self.model, self.opt, replace(self.state, seconds=self.state.seconds + elapsed))

    def _progress_bar(self) -> Any:
        if not (self.progress and self.dist.main):
            return None
        from tqdm import tqdm

        return tqdm(total=self.tc.max_steps or None, initial=self.state.step, desc="train", unit="step",
                    dynamic_ncols=True)

    # --- save / cleanup ------------------------------------------------------------

    def save(self, after_export: AfterExport | None = None) -> None:
        """Export the head to ``out_dir`` (rank 0), then run ``after_export`` on it."""
        if self.dist.main:
            save_head(self.model.cpu(), self.out_dir, self._manifest())
            if after_export is not None:
                self.acceptance = after_export(self.out_dir, self.features.runner)
        self._finished = True

    def _manifest(self) -> dict[str, Any]:
        """The head's lineage: parent, data, config, target and how it was trained."""
        st = self.state
        return {
            "parent": self.parent_sha,
            "data_snapshot": {"id": self.snapshot, "num_conversations": len(self.examples),
                              "data_until": self.data_until,
                              "content_hashes": sorted(e.content_hash for e in self.examples)},
            "config": {"training": self.tc.model_dump(mode="json"), "head": self.cfg.head.model_dump(mode="json")},
            "target": target_identity(self.target_dir),
            # From the state, so a resumed run that had already finished still reports them.
            "training": {"steps": st.step, "tokens": st.tokens, "final_depth_loss": st.depth_loss,
                         "final_depth_acc": st.depth_acc, "world_size": self.dist.world, "device": str(self.device),
                         "bf16_autocast": self.bf16, "attention": st.attention},
            "draft_vocab_refresh": self.vocab_refresh,
        }

    def cleanup(self) -> None:
        """Release the feature cache; after a finished run, also wait for every rank and leave the process group.

        After a failure the ranks are not joined: the others may never reach the barrier.
        """
        if self.features is not None:
            self.features.release()
        if self._finished:
            barrier(self.dist)
            teardown_distributed(self.dist)

    def result(self) -> TrainResult:
        st = self.state
        return TrainResult(
            out_dir=str(self.out_dir), steps=st.step, tokens=st.tokens, seconds=round(self.seconds, 3),
            tokens_per_s=round(self.tokens_run / max(self.seconds, 1e-9), 1), loss_curve=st.loss_curve,
            final_depth_loss=st.depth_loss, final_depth_acc=st.depth_acc, parent_sha=self.parent_sha,
            data_snapshot=self.snapshot, num_examples=len(self.examples),
            featurize_seconds=round(self.features.seconds, 3), acceptance=self.acceptance,
            extra={"tokenize": self.tokenize_report.to_dict(),
                   **({"draft_vocab_refresh": self.vocab_refresh} if self.vocab_refresh else {}),
                   **({"attention": self.attention.to_json()} if self.attention is not None else {}),
                   **({"feature_store": self.features.store.report()} if self.features.store is not None else {})},
        )
