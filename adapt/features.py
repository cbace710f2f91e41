"""The target's features for training: aux hidden states and distillation targets, cached in memory.

The target runs through :class:`adapt.hidden_states.TargetRunner` (aux states
exactly as vLLM records them) in the precision the step runs in: bf16 where
matmuls are native in bf16 (CUDA, AMX, AVX512-BF16), else fp32, because a CPU
without bf16 kernels emulates them and runs the target several times slower
than in fp32. Features are kept in bf16 either way. Target forwards dominate
CPU training time, so features are computed once per example and kept for
every later epoch, within a memory budget.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from adapt.data import Example
from adapt.hidden_states import TargetRunner
from adapt.loss import Features, label_rows, project_hidden
from adapt.memory import available_bytes, process_rss_bytes, trim_heap


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
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.runner = TargetRunner(target_dir, aux_layer_ids, device=str(device), dtype=dtype)
        self.draft_ids = draft_ids.to(self.runner.device)
        out_layer = self.runner.model.get_output_embeddings()
        self.output_rows = out_layer.weight.detach()[self.draft_ids].contiguous()  # [Vd, H], the target's dtype
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
        # Both are one matmul in the target's dtype; only accumulation order may differ (an ulp or two of bf16).
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

    def get(self, index: int, ex: Example) -> Features:
        """``ex``'s features (``index`` is its key), kept while both their bytes and the process's growth fit."""
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
