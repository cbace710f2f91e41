"""vLLM weight-transfer engine that loads a P-EAGLE drafter head from its safetensors file.

vLLM (0.32+) updates a running drafter through its own protocol: ``pause`` →
``start_draft_weight_update`` → ``update_weights`` → ``finish_weight_update`` (with a
``weight_version``) → ``resume``, each step a worker call that hands the chunks to the
configured weight-transfer engine. vLLM's engines stream tensors from a trainer (NCCL, CUDA
IPC); this one reads them from a head directory on the replica's host, so an update is a
path and the sha256 the caller expects:

    update_info = {"path": "/heads/v7", "sha256": "…"}

Registered as backend :data:`BACKEND` through vLLM's public ``vllm.general_plugins`` entry
point (:func:`register`, declared in ``serving/vllm_plugin/*.dist-info``), selected with
``--weight-transfer-config '{"backend": "drafter_adapt_head"}'``.

What P-EAGLE needs that the native path does not do, done here and checked:

* ``mask_hidden`` is a non-persistent buffer that the drafter's ``load_weights`` copies in
  directly; vLLM's layerwise reload puts the old buffer back afterwards, so the new value is
  written explicitly.
* The proposer caches ``fc(mask_hidden)`` (``parallel_drafting_hidden_state_tensor``) once,
  when the drafter is loaded; without a refresh a swapped head would draft its masked
  positions with the previous head's state. The proposer is found through the objects that
  hold the draft model (it is the one carrying that cache), and a parallel-drafting head for
  which no cache is found is refused before anything is written.
* Modules the drafter shares with the target (embeddings, ``lm_head``) are detached for the
  load, so the target's tensors are never touched; a head whose copy of them differs is refused.

The whole load happens inside ``update_weights`` (one worker call: no engine step runs between
moving the drafter's tensors to meta and putting them back); ``start`` and ``finish`` only
check and reset the session, and never raise in ``finish``, which vLLM calls to close it.
"""

from __future__ import annotations

import gc
import json
import time
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from headspec.config import shape_signature
from headspec.files import WEIGHTS, sha256_file
from serving.replica import plugin_entry_point_found
from serving.vllm_internals import AUX_HIDDEN, DEFAULT_MODEL, PD_CACHE, PROPOSER_MODEL, weight_transfer_registry

BACKEND = "drafter_adapt_head"


class HeadSwapError(RuntimeError):
    """The head cannot be loaded in place (the message says why)."""


@dataclass
class HeadInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the heads are files on this host."""


@dataclass
class HeadUpdateInfo(WeightTransferUpdateInfo):
    path: str
    sha256: str | None = None


def register() -> None:
    """``vllm.general_plugins`` entry point: make :data:`BACKEND` available (idempotent: vLLM loads
    general plugins once per process, but the API server, engine core and workers each do)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in weight_transfer_registry():
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "HeadFileEngine")


def _unwrap(m: Any) -> Any:
    """A module behind vLLM's graph wrappers (they expose ``unwrap()``), or ``m``."""
    unwrap = getattr(m, "unwrap", None)
    return unwrap() if callable(unwrap) else m


def find_pd_caches(draft: torch.nn.Module, max_depth: int = 3) -> list[Any]:
    """The objects (vLLM's proposer) that hold ``draft`` and cache ``fc(mask_hidden)`` for it.

    Walks the referrers of the draft model up to ``max_depth`` steps (the proposer holds the
    model directly, through its instance ``__dict__``, or through a graph wrapper).

    vLLM's engine core freezes the gc heap once started (``gc.freeze()``), and ``gc`` does not look
    for referrers among frozen objects: where the worker lives in the engine-core process
    (the single-GPU default, ``uni`` executor) the proposer is frozen, so the walk thaws the heap
    and freezes it again after.
    """
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    try:
        return _walk_referrers(draft, max_depth)
    finally:
        if frozen:
            # As vLLM's freeze does, young garbage first, so that freezing again does not keep it alive.
            gc.collect(0)
            gc.collect(1)
            gc.freeze()


def _walk_referrers(draft: torch.nn.Module, max_depth: int) -> list[Any]:
    frontier: list[Any] = [draft]
    seen = {id(draft)}
    found: list[Any] = []
    for _ in range(max_depth):
        refs = gc.get_referrers(*frontier)
        nxt: list[Any] = []
        for r in refs:
            if id(r) in seen or r is frontier or isinstance(r, (types.FrameType, list, tuple, set)):
                continue
            seen.add(id(r))
            attrs = getattr(r, "__dict__", None) if not isinstance(r, dict) else None
            if isinstance(attrs, dict) and PD_CACHE in attrs and _unwrap(attrs.get(PROPOSER_MODEL)) is draft:
                found.append(r)
            elif isinstance(r, dict) or callable(getattr(r, "unwrap", None)):
                nxt.append(r)
        if found or not nxt:
            return found
        frontier = nxt
    return found


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class HeadFileEngine(WeightTransferEngine[HeadInitInfo, HeadUpdateInfo]):
    init_info_cls = HeadInitInfo
    update_info_cls = HeadUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last: dict[str, Any] = {}
        # The proposers found for a draft model (a heap walk, paid by the first swap only).
        self._caches: tuple[weakref.ref, list[weakref.ref]] | None = None

    @property
    def _target(self) -> torch.nn.Module:
        return getattr(self, DEFAULT_MODEL)

    def _pd_caches(self, draft: torch.nn.Module) -> list[Any]:
        if self._caches is not None and self._caches[0]() is draft:
            found = [r() for r in self._caches[1]]
            if all(c is not None for c in found):
                return found
        found = [c for c in find_pd_caches(draft) if getattr(c, PD_CACHE) is not None]
        try:
            self._caches = (weakref.ref(draft), [weakref.ref(c) for c in found])
        except TypeError:  # not weakly referable: looked up again next time
            self._caches = None
        return found

    def init_transfer_engine(self, init_info: HeadInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        if self.model is self._target:
            raise HeadSwapError(f"the {BACKEND} engine loads drafter heads only: use start_draft_weight_update")

    def finish_weight_update(self) -> None:
        return None  # the load was whole inside update_weights; nothing is left half done

    def shutdown(self) -> None:
        return None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    # -- the load -----------------------------------------------------------------------------

    def _shared_modules(self, draft: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """Drafter submodules that are the target's own objects (outermost ones only)."""
        target_ids = {id(m) for m in self._target.modules()}
        shared = {n: m for n, m in draft.named_modules() if n and id(m) in target_ids}
        return {n: m for n, m in shared.items() if not any(n.startswith(o + ".") for o in shared if o != n)}

    def _target_fingerprint(self, shared: dict[str, torch.nn.Module]) -> dict[str, Any]:
        """Storage of every target parameter, plus a checksum of those the drafter shares."""
        fp: dict[str, Any] = {n: p.data_ptr() for n, p in self._target.named_parameters()}
        for mod_name, mod in shared.items():
            for n, p in mod.named_parameters():
                fp[f"shared:{mod_name}.{n}"] = float(p.detach().float().sum())
        return fp

    def _check_shapes(self, draft: torch.nn.Module, head: Path) -> None:
        new_cfg = json.loads((head / "config.json").read_text())
        # draft.config is vLLM's transformers PretrainedConfig, hence its to_dict (not our to_json).
        cur_sig, new_sig = shape_signature(draft.config.to_dict()), shape_signature(new_cfg)
        k = int(self.vllm_config.speculative_config.num_speculative_tokens)
        new_k = new_sig.pop("num_speculative_tokens")
        cur_sig.pop("num_speculative_tokens")
        diffs = {key: (cur_sig[key], new_sig[key]) for key in cur_sig
                 if new_sig[key] is not None and cur_sig[key] is not None and cur_sig[key] != new_sig[key]}
        if new_k is not None and int(new_k) != k:
            diffs["num_speculative_tokens"] = (k, int(new_k))
        if diffs:
            raise HeadSwapError(f"head shapes differ from the running drafter, restart needed: {diffs}")

    def receive_weights(self, update_info: HeadUpdateInfo) -> None:
        from safetensors import safe_open
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)

        t0 = time.perf_counter()
        draft = self.model
        if draft is self._target:
            raise HeadSwapError("no draft weight update is active (start_draft_weight_update first)")
        head = Path(update_info.path)
        self._check_shapes(draft, head)
        sha = sha256_file(head / WEIGHTS)
        if update_info.sha256 and sha != update_info.sha256:
            raise HeadSwapError(f"{head}/{WEIGHTS} sha256 {sha} != expected {update_info.sha256}")
        with safe_open(str(head / WEIGHTS), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}

        parallel = hasattr(draft, "mask_hidden")
        caches: list[Any] = []
        if parallel:
            if "mask_hidden" not in tensors:
                raise HeadSwapError("head has no mask_hidden (not a parallel-drafting head)")
            caches = self._pd_caches(draft)
            if not caches:
                # Found before anything is written: the running head stays as it is.
                raise HeadSwapError(f"no proposer caching fc(mask_hidden) ({PD_CACHE}) was found for the "
                                    "draft model: this vLLM drafts P-EAGLE heads otherwise; not swapping")

        # Never write into tensors shared with the target: drop the head's copy, but only if it
        # equals what is shared (a different one needs its own module: a restart).
        shared = self._shared_modules(draft)
        for mod_name, mod in shared.items():
            short = mod_name[len("model."):] if mod_name.startswith("model.") else mod_name
            params = dict(mod.named_parameters())
            for key in [k for k in tensors if k.startswith(short + ".")]:
                cur, new = params.get(key[len(short) + 1:]), tensors.pop(key)
                if cur is not None and (cur.shape != new.shape or not torch.equal(
                        cur.detach().to("cpu", torch.float32), new.to(torch.float32))):
                    raise HeadSwapError(f"head tensor {key} differs from the target's {mod_name} the drafter "
                                        "shares; restart needed")
        target_before = self._target_fingerprint(shared)

        # Detach the shared modules so the layerwise reload never moves the target's tensors to
        # meta and back (and cannot touch them by construction).
        parents = {}
        for mod_name in shared:
            parent_name, _, attr = mod_name.rpartition(".")
            parent = draft.get_submodule(parent_name) if parent_name else draft
            parents[mod_name] = (parent, attr, getattr(parent, attr))
            setattr(parent, attr, torch.nn.Identity())
        try:
            with torch.no_grad():
                initialize_layerwise_reload(draft)
                draft.load_weights(iter(list(tensors.items())))
                finalize_layerwise_reload(draft, self.model_config)
                if parallel:
                    # Non-persistent: the reload restored the old buffer from its snapshot.
                    draft.mask_hidden.copy_(tensors["mask_hidden"].to(draft.mask_hidden.dtype).view(1, -1))
        finally:
            for parent, attr, mod in parents.values():
                setattr(parent, attr, mod)

        with torch.no_grad():
            for c in caches:
                flat = draft.mask_hidden.view(-1)
                if getattr(c, AUX_HIDDEN, True):
                    flat = draft.combine_hidden_states(flat)
                getattr(c, PD_CACHE).copy_(flat)
        if parallel and not torch.equal(draft.mask_hidden.view(-1).to("cpu"),
                                        tensors["mask_hidden"].to(draft.mask_hidden.dtype).view(-1)):
            raise HeadSwapError("mask_hidden did not take the head's value")

        target_after = self._target_fingerprint(shared)
        if target_after != target_before:
            changed = [n for n in target_before if target_before[n] != target_after.get(n)]
            raise HeadSwapError(f"target tensors changed during the swap: {changed[:5]}")
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        self.last = {"path": str(head), "sha256": sha, "ms": (time.perf_counter() - t0) * 1000.0,
                     "pd_cache_sha256": [_digest(getattr(c, PD_CACHE)) for c in caches]}


def vllm_support() -> dict[str, bool]:
    """What the in-place swap needs from the installed vLLM, each item True when present (for
    ``adapt doctor``): the engine client's weight-update protocol, the weight-transfer engine
    factory, the public layerwise reload, this plugin's entry point, and the proposer's cached
    ``fc(mask_hidden)`` that the engine refreshes."""
    import importlib
    import importlib.util

    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.engine.protocol import EngineClient

    steps = ("pause_generation", "start_draft_weight_update", "update_weights", "finish_weight_update",
             "resume_generation", "get_weight_version", "reset_prefix_cache")
    reload = importlib.import_module("vllm.model_executor.model_loader.reload")
    proposer = importlib.util.find_spec("vllm.v1.spec_decode.llm_base_proposer")
    source = Path(proposer.origin).read_text() if proposer and proposer.origin else ""
    return {
        "weight_update_protocol": all(callable(getattr(EngineClient, m, None)) for m in steps),
        "weight_transfer_engine_factory": callable(getattr(WeightTransferEngineFactory, "register_engine", None)),
        "layerwise_reload": all(hasattr(reload, f) for f in ("initialize_layerwise_reload", "finalize_layerwise_reload")),
        "plugin_entry_point": plugin_entry_point_found(),
        "proposer_pd_cache": PD_CACHE in source,
    }
