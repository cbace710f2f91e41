"""vLLM worker extension that swaps the P-EAGLE drafter head in a running engine.

Loaded by ``vllm serve --worker-extension-cls serving.hotswap.HeadSwapExtension``;
its methods run inside each worker through ``collective_rpc`` (reached only via
the pool controller, see ``serving.admin``). Importable by vLLM's worker
processes because the pool puts the repository on their ``PYTHONPATH``.

Why not ``model.load_weights``: on CPU the linear weights are repacked after
loading, so writing checkpoint-format tensors into them corrupts the kernels.
vLLM's layerwise ``reload_weights`` re-runs the per-layer processing and copies
the result into the original storage, which is what in-place requires.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from headspec.config import shape_signature
from headspec.files import WEIGHTS, sha256_file


class HeadSwapError(RuntimeError):
    """The head cannot be loaded in place (the message says why)."""


class HeadSwapExtension:
    """Mixed into vLLM's Worker class; ``self`` is the worker."""

    # -- helpers ---------------------------------------------------------------

    def _drafter(self):
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "model"):
            raise HeadSwapError("this engine has no EAGLE drafter (start it with --speculative-config)")
        return drafter

    def _head_state(self) -> dict[str, Any]:
        st = getattr(self, "_adapt_head_state", None)
        if st is None:
            # First call: describe the head the engine was started with.
            path = Path(self.vllm_config.speculative_config.model)
            sha = sha256_file(path / WEIGHTS) if (path / WEIGHTS).is_file() else None
            version = None
            mf = path / "manifest.json"
            if mf.is_file():
                try:
                    version = json.loads(mf.read_text()).get("version")
                except ValueError:
                    pass
            st = {"path": str(path), "sha256": sha, "version": version, "swaps": 0,
                  "last_swap_ms": None, "loaded_at": time.time()}
            self._adapt_head_state = st
        return st

    def _shared_modules(self, drafter) -> dict[str, torch.nn.Module]:
        """Drafter submodules that are the target's own objects (shared embeddings / lm_head)."""
        target_ids = {id(m) for m in self.model_runner.model.modules()}
        shared = {}
        for name, mod in drafter.model.named_modules():
            if name and id(mod) in target_ids:
                shared[name] = mod
        # Keep only the outermost shared modules (their children go with them).
        return {n: m for n, m in shared.items() if not any(n.startswith(o + ".") for o in shared if o != n)}

    def _target_fingerprint(self, shared: dict[str, torch.nn.Module]) -> dict[str, Any]:
        """Storage of every target parameter, plus a checksum of those the drafter shares."""
        fp: dict[str, Any] = {n: p.data_ptr() for n, p in self.model_runner.model.named_parameters()}
        for mod_name, mod in shared.items():
            for n, p in mod.named_parameters():
                fp[f"shared:{mod_name}.{n}"] = float(p.detach().float().sum())
        return fp

    # -- RPC methods -----------------------------------------------------------

    def drafter_head_info(self) -> dict[str, Any]:
        """The loaded head: path, sha256 of its weights, version, swap count."""
        st = dict(self._head_state())
        drafter = self._drafter()
        st["num_speculative_tokens"] = int(drafter.num_speculative_tokens)
        pd = drafter.parallel_drafting_hidden_state_tensor
        # Digest of the cached fc(mask_hidden): equal after a swap and after a cold start
        # with the same head only if the cache was recomputed.
        st["pd_hidden_sha256"] = (hashlib.sha256(pd.detach().to("cpu").contiguous().view(torch.uint8)
                                                 .numpy().tobytes()).hexdigest() if pd is not None else None)
        st["shape"] = shape_signature(drafter.model.config.to_dict())
        return st

    def drafter_load_head(self, head_dir: str, version: str | None = None,
                          expected_sha256: str | None = None) -> dict[str, Any]:
        """Load ``head_dir`` in place; return the new head info, or ``{"error": ...}``.

        Errors are returned, not raised, so a refused head never disturbs the engine
        loop and the controller gets the reason verbatim.
        """
        try:
            return self._load_head(head_dir, version, expected_sha256)
        except Exception as exc:  # noqa: BLE001 - reported to the controller
            return {"error": f"{type(exc).__name__}: {exc}", "head": self._head_state()}

    def _load_head(self, head_dir: str, version: str | None, expected_sha256: str | None) -> dict[str, Any]:
        """Load ``head_dir`` into the running drafter in place; return the new head info.

        Refuses (HeadSwapError) a head whose shapes differ, whose weights hash does
        not match ``expected_sha256``, or that carries different values for a tensor
        the drafter shares with the target.
        """
        from safetensors import safe_open
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        t0 = time.perf_counter()
        d = Path(head_dir)
        drafter = self._drafter()
        model = drafter.model
        new_cfg = json.loads((d / "config.json").read_text())
        cur_cfg = model.config.to_dict()
        cur_sig, new_sig = shape_signature(cur_cfg), shape_signature(new_cfg)
        # K lives in the serving config, not necessarily in the head's config.json.
        new_k = new_sig.pop("num_speculative_tokens")
        cur_sig.pop("num_speculative_tokens")
        diffs = {k: (cur_sig[k], new_sig[k]) for k in cur_sig
                 if new_sig[k] is not None and cur_sig[k] is not None and cur_sig[k] != new_sig[k]}
        if new_k is not None and int(new_k) != int(drafter.num_speculative_tokens):
            diffs["num_speculative_tokens"] = (int(drafter.num_speculative_tokens), int(new_k))
        if diffs:
            raise HeadSwapError(f"head shapes differ from the running drafter, restart needed: {diffs}")

        sha = sha256_file(d / WEIGHTS)
        if expected_sha256 and sha != expected_sha256:
            raise HeadSwapError(f"{d}/{WEIGHTS} sha256 {sha} != expected {expected_sha256}")

        with safe_open(str(d / WEIGHTS), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if "mask_hidden" not in tensors:
            raise HeadSwapError("head has no mask_hidden (not a parallel-drafting head)")

        # Never write into tensors shared with the target: drop the head's copy, but
        # only if it equals what is shared (a different one needs its own module).
        shared = self._shared_modules(drafter)
        for mod_name, mod in shared.items():
            short = mod_name[len("model."):] if mod_name.startswith("model.") else mod_name
            for key in [k for k in tensors if k.startswith(short + ".")]:
                pname = key[len(short) + 1:]
                cur = dict(mod.named_parameters()).get(pname)
                new = tensors.pop(key)
                if cur is not None and (cur.shape != new.shape or not torch.equal(
                        cur.detach().to("cpu", torch.float32), new.to(torch.float32))):
                    raise HeadSwapError(
                        f"head tensor {key} differs from the target's {mod_name} the drafter shares; restart needed")

        target_before = self._target_fingerprint(shared)

        # Detach the shared modules so the layerwise reload never moves the target's
        # tensors to meta and back (and cannot touch them by construction).
        parents = {}
        for mod_name in shared:
            parent_name, _, attr = mod_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            parents[mod_name] = (parent, attr, getattr(parent, attr))
            setattr(parent, attr, torch.nn.Identity())
        draft_cfg = copy.copy(self.vllm_config)
        object.__setattr__(draft_cfg, "model_config", self.vllm_config.speculative_config.draft_model_config)
        try:
            with torch.no_grad():
                reload_weights(draft_cfg, model, iter(list(tensors.items())), None, True)
                # mask_hidden is a non-persistent buffer the layerwise reload restores
                # from its snapshot; write the new one explicitly.
                model.mask_hidden.copy_(tensors["mask_hidden"].to(model.mask_hidden.dtype).view(1, -1))
        finally:
            for parent, attr, mod in parents.values():
                setattr(parent, attr, mod)

        # The proposer caches fc(mask_hidden) at load time (llm_base_proposer.load_model).
        with torch.no_grad():
            if drafter.parallel_drafting_hidden_state_tensor is not None:
                flat = model.mask_hidden.view(-1)
                if getattr(drafter, "eagle3_use_aux_hidden_state", True):
                    flat = model.combine_hidden_states(flat)
                drafter.parallel_drafting_hidden_state_tensor.copy_(flat)

        target_after = self._target_fingerprint(shared)
        if target_after != target_before:
            changed = [n for n in target_before if target_before[n] != target_after.get(n)]
            raise HeadSwapError(f"target tensors changed during the swap: {changed[:5]}")

        st = self._head_state()
        st.update(path=str(d), sha256=sha, version=version, swaps=st["swaps"] + 1,
                  last_swap_ms=(time.perf_counter() - t0) * 1000.0, loaded_at=time.time())
        return self.drafter_head_info()

    def drafter_param_digest(self) -> dict[str, str]:
        """sha256 of every drafter and target parameter (for tests and audits)."""
        out = {}
        for prefix, mod in (("drafter", self._drafter().model), ("target", self.model_runner.model)):
            h = hashlib.sha256()
            for n, p in sorted(mod.named_parameters(), key=lambda x: x[0]):
                h.update(n.encode())
                h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
            out[prefix] = h.hexdigest()
        return out
