"""The target's features for training: aux hidden states and distillation targets, cached in memory.

The target runs through :class:`adapt.hidden_states.TargetRunner` (aux states
exactly as vLLM records them) in the precision the step runs in: bf16 where
matmuls are native in bf16 (CUDA, AMX, AVX512-BF16), else fp32, because a CPU
without bf16 kernels emulates them and runs the target several times slower
than in fp32. Features are kept in bf16 either way. Target forwards dominate
CPU training time, so features are computed once per example and kept for
every later epoch, within a memory budget.

The target runs over many examples per forward (:meth:`TargetFeatures.get_many`):
the missing examples of a step, sorted by length and cut into buckets of at
most ``batch_tokens`` padded tokens. On CUDA the features stay on the GPU (a
step gathers them there) while they fit a share of its free memory; on a CPU
they stay in host memory within the CPU budget.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from adapt.data import Example
from adapt.feature_store import FeatureStore
from adapt.hidden_states import TargetRunner
from adapt.loss import Features, label_rows, project_hidden
from adapt.memory import available_bytes, process_rss_bytes, trim_heap


# Padded tokens per featurization forward: enough rows for the target's matmuls to fill the device,
# few enough that one bucket's activations (and the hidden states kept for its aux layers) stay small.
FEATURIZE_TOKENS = {"cuda": 32768, "cpu": 4096}
# Share of the GPU's free memory (after the target and the head are loaded) the features may hold:
# the rest is the step's activations and the featurization forward's.
DEVICE_CACHE_SHARE = 0.5


def default_device_cache_bytes(device: torch.device) -> int:
    """Feature budget on a GPU: :data:`DEVICE_CACHE_SHARE` of its free memory now (each ``torchrun``
    rank owns its own GPU, so unlike host memory nothing is split)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * DEVICE_CACHE_SHARE)


def default_cache_bytes(local_world: int | None = None) -> int:
    """Feature-cache budget: 70% of the memory available now (Linux), else 6 GiB, split between
    the ranks ``torchrun`` starts on this machine (``LOCAL_WORLD_SIZE``; or ``local_world``).

    Recomputing features past the budget runs the target again every epoch,
    which is what a CPU run spends most of its time on, so the budget follows
    the machine. It bounds the process's real growth (see :class:`TargetFeatures`),
    so the remaining 30% is left for the step itself and for other processes.
    """
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = available_bytes(0)
    total = available * 7 // 10 if available else 6 << 30
    return total // max(1, local_world)


class TargetFeatures:
    """Aux hidden states and draft-vocab targets of the target, computed once per example.

    Features stay in memory (bf16) up to ``cache_bytes``; past the budget they
    are recomputed on demand (huge data sets trade compute for RAM).

    Features are compact where the target's output layer is a plain product of
    its final-norm output and its output embedding (checked on a probe, not
    assumed): they keep that hidden state per labelled row (the target's hidden
    size) instead of the draft-vocab logits (the draft vocabulary's size, many
    times larger), and the step recomputes the logits
    (:func:`adapt.loss.project_hidden`), so many more examples fit the budget.

    The budget bounds the process's real growth too, not only the cached
    tensors' bytes: featurizing sequences of many lengths grows resident memory
    well past those bytes (allocator and per-shape kernel caches), and a budget
    of tensor bytes alone can run the machine out of memory.
    """

    def __init__(self, target_dir: Path, aux_layer_ids: Sequence[int], draft_ids: torch.Tensor,
                 device: torch.device, cache_bytes: int | None = None, compact: bool = True,
                 dtype: torch.dtype = torch.bfloat16, batch_tokens: int | None = None,
                 device_map: str | dict | None = None, store: FeatureStore | None = None) -> None:
        self.runner = TargetRunner(target_dir, aux_layer_ids, device=str(device), dtype=dtype, device_map=device_map)
        self.store = store  # features of earlier runs, on disk (adapt.feature_store)
        self.on_device = self.runner.device.type == "cuda"
        self.batch_tokens = batch_tokens or FEATURIZE_TOKENS.get(self.runner.device.type, FEATURIZE_TOKENS["cpu"])
        self.draft_ids = draft_ids.to(self.runner.device)
        out_layer = self.runner.model.get_output_embeddings()
        self.output_rows = out_layer.weight.detach()[self.draft_ids].contiguous()  # [Vd, H], the target's dtype
        self.compact = compact and out_layer.bias is None and self._projection_matches()
        self.cache: dict[int, Features] = {}
        if cache_bytes is None:
            cache_bytes = default_device_cache_bytes(self.runner.device) if self.on_device else default_cache_bytes()
        self.cache_bytes = cache_bytes
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
        # Both are one matmul in the target's dtype; only accumulation order may differ (an ulp or two of bf16).
        return bool((got - want).abs().max() <= 2e-2 * want.abs().max().clamp(min=1.0))

    @torch.no_grad()
    def compute(self, ex: Example) -> Features:
        """One example's features, from a forward of its own."""
        t0 = time.perf_counter()
        rows = label_rows(ex.loss_mask)
        aux, logits = self.runner.forward(ex.input_ids, rows=rows)
        dev = self.runner.device
        # Only labelled slots read the target's argmax (their agreement metric).
        argmax = torch.full((len(ex.input_ids),), -1, dtype=torch.long, device=dev)
        argmax[rows.to(dev)] = logits.argmax(-1)
        if self.compact:
            kept = {"target_logits": None,
                    "target_hidden": self._own(self.runner.final_hidden()[rows.to(dev)])}
        else:
            kept = {"target_logits": self._own(logits[:, self.draft_ids])}
        f = Features(input_ids=ex.input_ids.to(self._store), loss_mask=ex.loss_mask, aux_hidden=self._own(aux),
                     target_argmax=argmax.to(self._store), logit_rows=rows, **kept)
        self.seconds += time.perf_counter() - t0
        return f

    @property
    def _store(self) -> torch.device:
        """Where features are kept: the GPU the target runs on, else host memory."""
        return self.runner.device if self.on_device else torch.device("cpu")

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in bf16 where features are kept, in storage of its own (never a view of a padded batch)."""
        return t.to(device=self._store, dtype=torch.bfloat16, copy=True)

    @torch.no_grad()
    def compute_many(self, examples: Sequence[Example]) -> list[Features]:
        """Features of ``examples`` (in their order) from as few target forwards as fit ``batch_tokens``.

        Examples are sorted by length and cut into buckets of at most
        ``batch_tokens`` padded tokens, right-padded with an attention mask, so
        each real position's states are its own sequence's (equal to
        :meth:`compute`'s up to the kernels' rounding). Index vectors cross to the
        device once per bucket; everything per example stays there. A target
        whose logits are not a plain product (not compact) runs one forward per example.
        """
        if not self.compact:
            return [self.compute(ex) for ex in examples]
        out: list[Features | None] = [None] * len(examples)
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
        bucket: list[int] = []
        for i in order:
            if bucket and (len(bucket) + 1) * len(examples[i]) > self.batch_tokens:
                self._bucket(examples, bucket, out)
                bucket = []
            bucket.append(i)
        if bucket:
            self._bucket(examples, bucket, out)
        return out  # type: ignore[return-value]

    def _bucket(self, examples: Sequence[Example], idx: list[int], out: list[Features | None]) -> None:
        t0 = time.perf_counter()
        exs = [examples[i] for i in idx]
        L = max(len(e) for e in exs)
        ids = torch.zeros(len(exs), L, dtype=torch.long)
        attn = torch.zeros(len(exs), L, dtype=torch.long)
        rows = [label_rows(e.loss_mask) for e in exs]
        for b, e in enumerate(exs):
            ids[b, :len(e)] = e.input_ids
            attn[b, :len(e)] = 1
        # Which (sequence, position) rows are labelled, for all sequences at once.
        which = torch.cat([torch.full_like(r, b) for b, r in enumerate(rows)])
        pos = torch.cat(rows)
        dev = self.runner.device
        aux, final = self.runner.forward_batch(ids, attn)
        which, pos = which.to(dev), pos.to(dev)
        hidden = final[which, pos]  # [R, H]
        argmax = torch.cat([self.runner.output_layer(h).argmax(-1) for h in hidden.split(4096)]) if len(pos) \
            else torch.zeros(0, dtype=torch.long, device=dev)
        ids_store = ids.to(self._store)
        at = 0
        for b, (i, e, r) in enumerate(zip(idx, exs, rows)):
            n, R = len(e), r.numel()
            am = torch.full((n,), -1, dtype=torch.long, device=dev)
            am[pos[at:at + R]] = argmax[at:at + R]
            out[i] = Features(input_ids=ids_store[b, :n].clone(), loss_mask=e.loss_mask,
                              aux_hidden=self._own(aux[b, :n]), target_logits=None,
                              target_argmax=am.to(self._store), logit_rows=r, target_hidden=self._own(hidden[at:at + R]))
            at += R
        self.seconds += time.perf_counter() - t0

    def _keep(self, index: int, f: Features) -> None:
        """Cache ``f`` while both its bytes and (host memory) the process's growth fit the budget."""
        size = f.nbytes
        grown = 0
        if not self.on_device:
            rss = process_rss_bytes()
            grown = rss - self.rss_start if rss is not None and self.rss_start is not None else 0
        if max(self.used_bytes, grown) + size <= self.cache_bytes:
            self.cache[index] = f
            self.used_bytes += size

    def _stored(self, ex: Example) -> Features | None:
        """``ex``'s features from the store (compact ones only: the store keeps no logits)."""
        if self.store is None or not self.compact:
            return None
        f = self.store.load(ex)
        if f is None:
            return None
        return Features(input_ids=f.input_ids.to(self._store), loss_mask=f.loss_mask,
                        aux_hidden=f.aux_hidden.to(self._store), target_logits=None,
                        target_argmax=f.target_argmax.to(self._store), logit_rows=f.logit_rows,
                        target_hidden=f.target_hidden.to(self._store))

    def _stash(self, ex: Example, f: Features) -> None:
        if self.store is not None and self.compact:
            self.store.save(ex, f)

    def get(self, index: int, ex: Example) -> Features:
        """``ex``'s features (``index`` is its key), kept while both their bytes and the process's growth fit."""
        if index in self.cache:
            return self.cache[index]
        f = self._stored(ex)
        if f is None:
            f = self.compute(ex)
            self._stash(ex, f)
        self._keep(index, f)
        return f

    def get_many(self, indices: Sequence[int], examples: Sequence[Example]) -> list[Features]:
        """:meth:`get` for many examples: the ones neither cached nor stored are featurized together
        (:meth:`compute_many`)."""
        fresh: dict[int, Features] = {}
        missing = []
        for j, i in enumerate(indices):
            if i not in self.cache:
                f = self._stored(examples[j])
                if f is None:
                    missing.append(j)
                else:
                    fresh[j] = f
        for j, f in zip(missing, self.compute_many([examples[j] for j in missing])):
            fresh[j] = f
            self._stash(examples[j], f)
        out = []
        for j, i in enumerate(indices):
            if j in fresh:
                self._keep(i, fresh[j])
                out.append(fresh[j])
            else:
                out.append(self.cache[i])
        return out

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
