"""The training recipe: conversations in, a vLLM-loadable P-EAGLE head out.

:class:`TrainRecipe` runs in four phases over small components:

``setup``    the data (chat template, assistant-only loss, replay mix), the
             starting head (:mod:`adapt.initial_head`: warm start or bootstrap),
             the target's features (:mod:`adapt.features`), AdamW, the resumable
             state (:mod:`adapt.run_state`) and DDP under ``torchrun``
             (:mod:`adapt.distributed`)
``train``    the loop: warmup + cosine within step and wall-time bounds
             (:mod:`adapt.schedule`), grad clip, fp32 master weights (bf16
             autocast optional), a checkpoint every ``checkpoint_steps``
``save``     the head with its lineage in the manifest (``adapt.checkpoint.save_head``)
``cleanup``  the feature cache released, the ranks joined

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
from adapt.distributed import barrier, init_distributed, max_over_ranks, teardown_distributed, wrap_data_parallel
from adapt.features import TargetFeatures
from adapt.hidden_states import TargetRunner
from adapt.initial_head import initial_head
from adapt.loss import LossOutput, collate, peagle_loss
from adapt.memory import heap_kept_between_steps
from adapt.run_state import RunState, load_run_state, run_fingerprint, save_run_state, trainable
from adapt.schedule import Schedule
from headspec.files import target_identity
from settings.config import Config
from targets.model_zoo import ensure_target

# Called on rank 0 with the exported head and the target already loaded (e.g. an offline acceptance estimate).
AfterExport = Callable[[Path, TargetRunner], dict[str, Any]]


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
        self.tokens_run, self.seconds = 0, 0.0  # this session's, not the resumed run's
        self._finished = False

    # --- setup ---------------------------------------------------------------------

    def setup(self, conversations: Sequence[dict[str, Any]], base_head: str | None = None,
              replay_conversations: Sequence[dict[str, Any]] | None = None) -> None:
        """The device and ranks, the examples, the initial head, the target's features, AdamW (resumed) and batches."""
        tc = self.tc
        self.device = pick_device(tc.device)
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
        self.features = TargetFeatures(self.target_dir, self.model.config.aux_layer_ids, draft_ids.cpu(), self.device,
                                       dtype=torch.bfloat16 if self.bf16 else torch.float32)
        self._setup_optimizer()
        self.batches = StepBatches([len(e) for e in self.examples], tc.batch_tokens, tc.max_seq_len, tc.seed,
                                   self.dist.rank, self.dist.world)

    def _setup_data(self, conversations: Sequence[dict[str, Any]],
                    replay: Sequence[dict[str, Any]] | None) -> int | None:
        """Tokenized examples (new + replayed) and their snapshot id; returns the end-of-turn token id."""
        from transformers import AutoTokenizer  # heavy: only once a run starts

        tc = self.tc
        tok = AutoTokenizer.from_pretrained(self.target_dir)
        rows = mix_replay(list(conversations), list(replay or []), tc.replay_ratio, tc.seed)
        self.examples = tokenize_rows(tok, rows, tc.max_seq_len)
        if not self.examples:
            raise ValueError("no conversation has assistant tokens to train on")
        self.snapshot = snapshot_id(self.examples)
        return tok.eos_token_id

    def _setup_optimizer(self) -> None:
        """AdamW over the trainable weights, resumed from ``run_dir`` when it holds this run; DDP when launched so."""
        tc = self.tc
        self.opt = torch.optim.AdamW(list(trainable(self.model).values()), lr=tc.learning_rate,
                                     weight_decay=tc.weight_decay, betas=(0.9, 0.95))
        fingerprint = run_fingerprint(self.cfg, self.parent_sha, self.snapshot)
        self.state = load_run_state(self.run_dir, self.model, self.opt, fingerprint) or RunState(fingerprint)
        self.ddp_model = wrap_data_parallel(self.model, self.device, self.dist)

    # --- train ---------------------------------------------------------------------

    def train(self) -> None:
        """Steps until ``max_steps``, the wall-time cap or ``stop_after_steps``; checkpoints along the way and at the end."""
        st, schedule = self.state, self.schedule
        schedule.start()
        bar = self._progress_bar()
        t_start = time.perf_counter()
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
                    self._checkpoint(time.perf_counter() - t_start)
        if bar is not None:
            bar.close()
        self.seconds = time.perf_counter() - t_start
        if self.dist.main:
            self._checkpoint(self.seconds)

    def _step(self, step: int, time_used: float) -> tuple[LossOutput, int]:
        """One optimizer step on this rank's batch; returns its loss and the tokens all ranks trained on."""
        tc, model, features = self.tc, self.model, self.features
        k = model.config.num_speculative_tokens
        feats = [[features.get(i, self.examples[i]) for i in row] for row in self.batches(step)]
        gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + step * 7919 + self.dist.rank)
        batch = collate(feats, k, model.config.ptd_token_id, tc.depth_keep, gen).to(self.device)
        batch.project_targets(features.output_rows)
        for g in self.opt.param_groups:
            g["lr"] = self.schedule.lr(step, time_used)
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext():
            logits = self.ddp_model(**batch.model_inputs(), select=batch.valid)
        out = peagle_loss(logits, batch, model.d2t, tc.depth_weights, k)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        self.opt.step()
        return out, batch.num_tokens * self.dist.world

    def _record(self, out: LossOutput, ntok: int, bar: Any, elapsed: float) -> None:
        st = self.state
        st.step += 1
        st.tokens += ntok
        self.tokens_run += ntok
        st.loss_curve.append(round(float(out.loss.detach()), 6))
        st.depth_loss, st.depth_acc = out.depth_loss.tolist(), out.depth_acc.tolist()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(out.loss.detach()):.3f}", acc1=f"{float(out.depth_acc[0]):.2f}",
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
                              "content_hashes": sorted(e.content_hash for e in self.examples)},
            "config": {"training": self.tc.model_dump(mode="json"), "head": self.cfg.head.model_dump(mode="json")},
            "target": target_identity(self.target_dir),
            # From the state, so a resumed run that had already finished still reports them.
            "training": {"steps": st.step, "tokens": st.tokens, "final_depth_loss": st.depth_loss,
                         "final_depth_acc": st.depth_acc, "world_size": self.dist.world, "device": str(self.device),
                         "bf16_autocast": self.bf16},
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
            extra={"draft_vocab_refresh": self.vocab_refresh} if self.vocab_refresh else {},
        )
