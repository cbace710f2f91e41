"""The training recipe: conversations in, a vLLM-loadable P-EAGLE head out.

Read top to bottom, :func:`train` is the whole recipe:

1. data    tokenize (chat template, assistant-only loss) + replay mix
2. model   warm start from a head (dir or ``models:/name/version``) or bootstrap
           from the target with a draft vocabulary picked by token frequency
3. target  aux hidden states + logits per example, computed once, kept in memory
4. loop    AdamW, warmup + cosine, grad clip, fp32 master weights (bf16 autocast
           optional), checkpoint/resume, DDP under ``torchrun``
5. export  ``adapt.checkpoint.save_head`` with lineage in the manifest

Every random choice (batch order, depth down-sampling) is a pure function of
``(seed, step)``, so a resumed run replays exactly what an uninterrupted one does
(under a wall-time cap the learning rate also follows the clock, so only the
data and sampling replay exactly).
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from adapt.checkpoint import init_output_from_target, load_head, new_head, save_head, target_output_layer
from headspec.files import sha256_file, target_identity
from headspec.validate import validate_head
from adapt.data import (
    Example,
    build_draft_vocab,
    make_batches,
    mix_replay,
    snapshot_id,
    token_counts,
    tokenize_rows,
)
from adapt.device import pick_device, use_bf16_autocast
from adapt.drafter import PEagleDrafter
from headspec.config import DrafterConfig, shape_differences
from headspec.resolve import resolve_head
from adapt.loss import Features, collate, label_rows, peagle_loss, project_hidden
from adapt.memory import available_bytes

RUN_STATE = "train_state.json"
RUN_MODEL = "model.safetensors"
RUN_OPTIM = "optimizer.safetensors"


class ShapeChangeError(ValueError):
    """The configured head shape differs from the warm-start head's."""


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


# --- distributed ------------------------------------------------------------------

@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> Dist:
    """Join the ``torchrun`` process group when launched by it (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the cores; oversubscribed OpenMP threads spin and crawl.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return Dist(dist.get_rank(), dist.get_world_size())


# --- model --------------------------------------------------------------------------

def resolve_base(base: str, cfg: Any) -> Path:
    """A head directory for ``base``: a local directory, an S3 URI or an MLflow ``models:/`` / ``runs:/`` URI
    (downloaded under ``[head].heads_dir/downloaded`` from ``[mlflow].tracking_uri``)."""
    path, _ = resolve_head(base, Path(cfg.head.heads_dir) / "downloaded", cfg.mlflow.tracking_uri,
                           cfg.s3.client_kwargs())
    if not path.is_dir():
        raise FileNotFoundError(f"base head {base!r} is neither a directory nor an MLflow model URI")
    return path


def configured_head(cfg: Any, target_dir: Path) -> DrafterConfig:
    h = cfg.head
    return DrafterConfig.from_target(target_dir, h.num_speculative_tokens, h.draft_vocab_size,
                                     h.aux_layer_ids or None, h.num_layers)


def check_same_shape(head: DrafterConfig, want: DrafterConfig) -> None:
    """Warm start never changes a head's shape: what an in-place swap needs equal (:func:`shape_differences`)."""
    diffs = [f"{f}: head has {a}, config asks {b}" for f, (a, b) in shape_differences(head, want).items()]
    if diffs:
        raise ShapeChangeError("warm start cannot change the head's shape (" + "; ".join(diffs)
                               + "); bootstrap a new head (no --base) instead")


def bootstrap_head(cfg: Any, target_dir: Path, examples: Sequence[Example], eos_id: int | None) -> PEagleDrafter:
    """A fresh head whose draft vocabulary is the most frequent assistant tokens.

    Its final norm and ``lm_head`` start from the target's (the draft vocabulary's
    rows): after drifted-traffic adaptation such heads accepted more than randomly
    initialised ones (offline estimate 1.47 vs 1.45 at equal steps).
    """
    want = configured_head(cfg, target_dir)
    model = new_head(target_dir, want.num_speculative_tokens, want.draft_vocab_size,
                     want.aux_layer_ids, want.num_layers, seed=cfg.training.seed)
    counts = token_counts(examples, want.vocab_size)
    specials = [eos_id] if eos_id is not None else []
    d2t, _ = build_draft_vocab(counts, want.draft_vocab_size, special_ids=specials)
    model.set_draft_vocab(d2t + torch.arange(d2t.numel()))
    init_output_from_target(model, target_dir)
    return model


def refresh_draft_vocab(model: PEagleDrafter, examples: Sequence[Example], eos_id: int | None,
                        output_rows: torch.Tensor | None = None) -> dict[str, Any]:
    """Re-pick the draft vocabulary of a warm-started head for ``examples`` (same size).

    Ranked by frequency in the new data (replay included); at equal counts a token
    already in the vocabulary keeps its slot, so a refresh only moves what the
    data asks for; tokens new to it start from ``output_rows`` (the target's output
    embedding) when given. Returns coverage of the tokens to predict before and after.
    """
    cfg = model.config
    counts = token_counts(examples, cfg.vocab_size)
    held = model.t2d.cpu().bool()
    specials = [eos_id] if eos_id is not None else []
    # Doubling counts then adding 1 for held tokens breaks ties towards the current vocabulary.
    d2t, t2d = build_draft_vocab(counts * 2 + held.long(), cfg.draft_vocab_size, special_ids=specials)
    total = max(int(counts.sum()), 1)
    before = int(counts[held].sum()) / total
    added = model.remap_draft_vocab(d2t + torch.arange(d2t.numel()), output_rows)
    return {"added_tokens": added, "coverage_before": round(before, 4),
            "coverage_after": round(int(counts[t2d].sum()) / total, 4)}


# --- target features -------------------------------------------------------------

def default_cache_bytes(local_world: int | None = None) -> int:
    """Feature-cache budget: 70% of the memory available now (Linux), else 6 GiB, split between
    the ranks ``torchrun`` starts on this machine (``LOCAL_WORLD_SIZE``; or ``local_world``).

    Recomputing features past the budget runs the target again every epoch,
    which slows a CPU run several-fold, so the budget follows the machine. It
    bounds the process's real growth (see :class:`TargetFeatures`), so the
    remaining 30% is left for the step itself and for other processes.
    """
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = available_bytes(0)
    total = available * 7 // 10 if available else 6 << 30
    return total // max(1, local_world)


def _glibc() -> Any | None:
    """glibc, for its malloc tuning calls; None on other C libraries."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def trim_heap() -> bool:
    """Return free heap pages to the OS (glibc ``malloc_trim``); False where unavailable."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


# glibc mallopt parameters and their defaults (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


@contextmanager
def heap_kept_between_steps():
    """Inside, glibc serves large blocks from its heap and keeps freed ones for reuse.

    By default a CPU step's large tensors (above glibc's 32 MiB mmap ceiling)
    are mmapped, unmapped when freed and faulted in again page by page the next
    step: measured on SmolLM2 features, 225k minor faults per step and 0.99 s
    steps, against 5k faults and 0.77 s with the heap kept (peak RSS +6%). The
    defaults come back on exit and the heap's free pages go back to the OS.
    """
    libc = _glibc()
    if libc is None:
        yield False  # not glibc: nothing to tune
        return
    ok = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    try:
        yield ok
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        trim_heap()


def process_rss_bytes() -> int | None:
    """Resident memory of this process (Linux ``/proc``), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class TargetFeatures:
    """Aux hidden states and draft-vocab targets of the target, computed once per example.

    The target runs in bf16 through :class:`adapt.hidden_states.TargetRunner`
    (aux states exactly as vLLM records them, and the precision vLLM serves in).
    Target forwards dominate CPU training time, so features stay in memory (bf16)
    up to ``cache_bytes`` and every later epoch reuses them; past the budget they
    are recomputed (huge data sets trade compute for RAM).

    Features are compact where the target's output layer is a plain product of
    its final-norm output and its output embedding (checked on a probe, not
    assumed): they keep that hidden state per labelled row (H_target values, 576
    for SmolLM2) instead of the draft-vocab logits (8,192), and the step
    recomputes the logits (:func:`adapt.loss.project_hidden`). That keeps ~2.5x more examples per GB.

    The budget bounds the process's real growth too: featurizing sequences of
    many lengths grows resident memory ~2x the cached tensors' bytes (allocator
    and per-shape kernel caches), and a budget of tensor bytes alone let a
    half-of-RAM default run a 24 GiB machine out of memory.
    """

    def __init__(self, target_dir: Path, aux_layer_ids: Sequence[int], draft_ids: torch.Tensor,
                 device: torch.device, cache_bytes: int | None = None, compact: bool = True) -> None:
        from adapt.hidden_states import TargetRunner

        self.runner = TargetRunner(target_dir, aux_layer_ids, device=str(device), dtype=torch.bfloat16)
        self.draft_ids = draft_ids.to(self.runner.device)
        out_layer = self.runner.model.get_output_embeddings()
        self.output_rows = out_layer.weight.detach()[self.draft_ids].contiguous()  # [Vd, H] bf16
        self.compact = compact and out_layer.bias is None and self._projection_matches()
        self.cache: dict[int, Features] = {}
        self.cache_bytes = default_cache_bytes() if cache_bytes is None else cache_bytes
        self.used_bytes = 0
        self.seconds = 0.0
        self.rss_start = process_rss_bytes()

    @torch.no_grad()
    def _projection_matches(self) -> bool:
        """Whether final hidden @ output rows reproduces the target's logits (no soft-capping, scaling, ...)."""
        n = min(32, self.runner.model.config.vocab_size)
        ids = torch.arange(n) * (self.runner.model.config.vocab_size // n)
        _, logits = self.runner.forward(ids)
        want = logits[:, self.draft_ids]
        got = project_hidden(self.runner.final_hidden(), self.output_rows).float()
        # Both are one bf16 matmul; only accumulation order may differ (an ulp or two of bf16).
        return bool((got - want).abs().max() <= 2e-2 * want.abs().max().clamp(min=1.0))

    @torch.no_grad()
    def compute(self, ex: Example) -> Features:
        t0 = time.perf_counter()
        rows = label_rows(ex.loss_mask)
        aux, logits = self.runner.forward(ex.input_ids, rows=rows)
        # Only labelled slots read the target's argmax (their agreement metric).
        argmax = torch.full((len(ex.input_ids),), -1, dtype=torch.long)
        argmax[rows] = logits.argmax(-1).cpu()
        if self.compact:
            kept = {"target_logits": None,
                    "target_hidden": self.runner.final_hidden()[rows.to(aux.device)].to(torch.bfloat16).cpu()}
        else:
            kept = {"target_logits": logits[:, self.draft_ids].to(torch.bfloat16).cpu()}
        f = Features(input_ids=ex.input_ids, loss_mask=ex.loss_mask, aux_hidden=aux.to(torch.bfloat16).cpu(),
                     target_argmax=argmax, logit_rows=rows, **kept)
        self.seconds += time.perf_counter() - t0
        return f

    def release(self) -> None:
        """Drop the cached features and hand the freed heap back to the OS.

        glibc keeps a fragmented heap after the cache's tensors are freed: a process
        that trains and then starts vLLM servers (the benchmark, a nightly cycle)
        would otherwise start them with training's peak memory still resident.
        """
        self.cache.clear()
        self.used_bytes = 0
        gc.collect()
        trim_heap()

    def get(self, index: int, ex: Example) -> Features:
        if index in self.cache:
            return self.cache[index]
        f = self.compute(ex)
        size = f.nbytes
        rss = process_rss_bytes()
        grown = rss - self.rss_start if rss is not None and self.rss_start is not None else 0
        if max(self.used_bytes, grown) + size <= self.cache_bytes:
            self.cache[index] = f
            self.used_bytes += size
        return f


# --- schedule / checkpoints ------------------------------------------------------

def lr_at(step: int, base_lr: float, warmup: int, total: int, time_used: float = 0.0) -> float:
    """Linear warmup, then cosine decay to 10% of ``base_lr`` at ``total`` steps.

    ``time_used`` (0..1, the share of a wall-time cap spent) moves the decay ahead
    when the cap will end the run before ``total``: a capped run still anneals.
    Without either bound the rate stays constant after warmup.
    """
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    by_steps = (step - warmup) / max(1, total - warmup) if total > warmup else 0.0
    progress = min(1.0, max(by_steps, time_used))
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def trainable(model: PEagleDrafter) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_run_state(run_dir: Path, model: PEagleDrafter, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Trainable weights + AdamW moments as safetensors, step/curves as JSON (no pickle)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    params = trainable(model)
    save_file({n: p.detach().cpu().contiguous() for n, p in params.items()}, str(run_dir / f".{RUN_MODEL}"))
    moments: dict[str, torch.Tensor] = {}
    for n, p in params.items():
        for k, v in opt.state.get(p, {}).items():
            moments[f"{n}::{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
    save_file(moments, str(run_dir / f".{RUN_OPTIM}"))
    (run_dir / f".{RUN_STATE}").write_text(json.dumps(state, indent=1))
    # Rename last: a crash mid-save leaves the previous complete checkpoint.
    for name in (RUN_MODEL, RUN_OPTIM, RUN_STATE):
        os.replace(run_dir / f".{name}", run_dir / name)


def load_run_state(run_dir: Path, model: PEagleDrafter, opt: torch.optim.Optimizer,
                   fingerprint: str) -> dict[str, Any] | None:
    """Restore a checkpoint written by :func:`save_run_state` for the same run; None if absent/foreign."""
    if not (run_dir / RUN_STATE).is_file():
        return None
    state = json.loads((run_dir / RUN_STATE).read_text())
    if state.get("fingerprint") != fingerprint:
        return None
    params = trainable(model)
    weights = load_file(str(run_dir / RUN_MODEL))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n].to(p.device, p.dtype))
    moments = load_file(str(run_dir / RUN_OPTIM))
    for n, p in params.items():
        st = {k.split("::", 1)[1]: v.to(p.device) for k, v in moments.items() if k.split("::", 1)[0] == n}
        if st:
            opt.state[p] = st
    return state


def run_fingerprint(cfg: Any, parent_sha: str | None, snapshot: str) -> str:
    import hashlib

    blob = json.dumps({"training": cfg.training.model_dump(mode="json"), "head": cfg.head.model_dump(mode="json"),
                       "target": cfg.target.model, "parent": parent_sha, "data": snapshot}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# --- the recipe ---------------------------------------------------------------------

def train(
    cfg: Any,
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
    if tc.max_steps <= 0 and tc.max_minutes <= 0:
        raise ValueError("set training.max_steps or training.max_minutes: the run needs a bound")
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
    parent_sha = None
    vocab_refresh: dict[str, Any] | None = None
    if base_head:
        head_dir = resolve_base(base_head, cfg)
        info = validate_head(head_dir, target_dir)
        model, _ = load_head(head_dir)
        check_same_shape(model.config, configured_head(cfg, target_dir))
        parent_sha = info.sha256
        if tc.refresh_draft_vocab:
            vocab_refresh = refresh_draft_vocab(model, examples, tok.eos_token_id,
                                                target_output_layer(target_dir)[1])
    else:
        model = bootstrap_head(cfg, target_dir, examples, tok.eos_token_id)
    model = model.to(device=device, dtype=torch.float32).train()
    K = model.config.num_speculative_tokens
    draft_ids = torch.arange(model.config.draft_vocab_size, device=model.d2t.device) + model.d2t

    # 3. target features (lazily, only for the examples this rank trains on)
    target = TargetFeatures(target_dir, model.config.aux_layer_ids, draft_ids.cpu(), device)

    # 4. loop
    opt = torch.optim.AdamW(list(trainable(model).values()), lr=tc.learning_rate, weight_decay=tc.weight_decay,
                            betas=(0.9, 0.95))
    fingerprint = run_fingerprint(cfg, parent_sha, snapshot)
    state = load_run_state(run_dir, model, opt, fingerprint) or {"step": 0, "tokens": 0, "seconds": 0.0,
                                                                 "loss_curve": [], "fingerprint": fingerprint}
    ddp_model = model
    if dd.world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    use_bf16 = use_bf16_autocast(tc.dtype, device)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext

    lengths = [len(e) for e in examples]
    epoch_cache: dict[int, list] = {0: make_batches(lengths, tc.batch_tokens, tc.max_seq_len, tc.seed, 0)}
    # Every rank runs the same number of steps per epoch (the remainder batches wait for the next epoch's shuffle).
    per_epoch = max(1, len(epoch_cache[0]) // dd.world)

    def batch_for(step: int) -> list[list[int]]:
        epoch, i = divmod(step, per_epoch)
        if epoch not in epoch_cache:
            epoch_cache.clear()
            epoch_cache[epoch] = make_batches(lengths, tc.batch_tokens, tc.max_seq_len, tc.seed, epoch)
        batches = epoch_cache[epoch]
        return batches[(i * dd.world + dd.rank) % len(batches)]

    max_steps = tc.max_steps if tc.max_steps > 0 else (1 << 62)
    total_for_schedule = tc.max_steps
    deadline = time.monotonic() + tc.max_minutes * 60 if tc.max_minutes > 0 else None

    def time_used() -> float:
        return 1.0 - (deadline - time.monotonic()) / (tc.max_minutes * 60) if deadline is not None else 0.0
    bar = None
    if progress and dd.main:
        from tqdm import tqdm

        bar = tqdm(total=tc.max_steps or None, initial=state["step"], desc="train", unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    tokens_run = 0
    step = state["step"]
    # CPU steps reuse their freed large blocks instead of faulting fresh pages in (see heap_kept_between_steps).
    with heap_kept_between_steps() if device.type == "cpu" else nullcontext():
        while step < max_steps:
            # One value for all ranks: they must stop at the same step and use the same rate.
            used = _max_over_ranks(time_used(), dd) if deadline is not None else 0.0
            if used >= 1.0:
                break
            if stop_after_steps is not None and step >= stop_after_steps:
                break
            rows_idx = batch_for(step)
            feats = [[target.get(i, examples[i]) for i in row] for row in rows_idx]
            gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + step * 7919 + dd.rank)
            batch = collate(feats, K, model.config.ptd_token_id, tc.depth_keep, gen).to(device)
            batch.project_targets(target.output_rows)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, tc.learning_rate, tc.warmup_steps, total_for_schedule, used)
            with autocast():
                logits = ddp_model(**batch.model_inputs(), select=batch.valid)
            out = peagle_loss(logits, batch, model.d2t, tc.depth_weights, K)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            step += 1
            ntok = batch.num_tokens * dd.world
            tokens_run += ntok
            state["tokens"] += ntok
            state["loss_curve"].append(round(float(out.loss.detach()), 6))
            state["depth_loss"], state["depth_acc"] = out.depth_loss.tolist(), out.depth_acc.tolist()
            if bar is not None:
                el = time.perf_counter() - t_start
                bar.update(1)
                bar.set_postfix(loss=f"{float(out.loss.detach()):.3f}", acc1=f"{float(out.depth_acc[0]):.2f}",
                                tok_s=f"{tokens_run / max(el, 1e-9):.0f}")
            if step % tc.checkpoint_steps == 0 and dd.main:
                save_run_state(run_dir, model, opt,
                               {**state, "step": step, "seconds": state["seconds"] + time.perf_counter() - t_start})
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    state.update(step=step)
    if dd.main:
        seconds_total = state["seconds"] + elapsed
        save_run_state(run_dir, model, opt, {**state, "seconds": seconds_total})
    # From the state, so a resumed run that had already finished still reports them.
    depth_loss, depth_acc = state.get("depth_loss", []), state.get("depth_acc", [])

    # 5. export
    acceptance = None
    if dd.main:
        manifest = {
            "parent": parent_sha,
            "data_snapshot": {"id": snapshot, "num_conversations": len(examples),
                              "content_hashes": sorted(e.content_hash for e in examples)},
            "config": {"training": tc.model_dump(mode="json"), "head": cfg.head.model_dump(mode="json")},
            "target": target_identity(target_dir),
            "training": {"steps": step, "tokens": state["tokens"], "final_depth_loss": depth_loss,
                         "final_depth_acc": depth_acc, "world_size": dd.world, "device": str(device),
                         "bf16_autocast": use_bf16},
            "draft_vocab_refresh": vocab_refresh,
        }
        save_head(model.cpu(), out_dir, manifest)
        if after_export is not None:
            # e.g. an offline acceptance estimate, reusing the target already loaded here
            acceptance = after_export(out_dir, target.runner)
    target.release()
    if dd.world > 1:
        dist.barrier()
    return TrainResult(
        out_dir=str(out_dir), steps=step, tokens=state["tokens"], seconds=round(elapsed, 3),
        tokens_per_s=round(tokens_run / max(elapsed, 1e-9), 1), loss_curve=state["loss_curve"],
        final_depth_loss=depth_loss, final_depth_acc=depth_acc, parent_sha=parent_sha, data_snapshot=snapshot,
        num_examples=len(examples), featurize_seconds=round(target.seconds, 3), acceptance=acceptance,
        extra={"draft_vocab_refresh": vocab_refresh} if vocab_refresh else {},
    )


def _max_over_ranks(value: float, dd: Dist) -> float:
    """The largest ``value`` of all ranks, on every rank."""
    if dd.world <= 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
