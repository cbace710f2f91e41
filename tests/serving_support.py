"""Shared by the serving tests (a support module: no test module imports another)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors.torch import load_file, save_file


def constant_token_head(src: Path, dst: Path, token_id: int) -> Path:
    """Copy of ``src`` whose draft is always ``token_id``: final norm zeroed, draft vocab mapped so the
    draft is always that token (the tiny target emits token 1 often): non-zero acceptance, and two such
    heads from different random heads behave alike with different weights and sha256."""
    t = load_file(str(src / "model.safetensors"))
    t["norm.weight"] = torch.zeros_like(t["norm.weight"])
    # All draft logits tie at 0; vLLM's argmax takes the smallest target id among
    # them, so map the draft vocab onto token_id, token_id+1, ...
    n = t["d2t"].numel()
    t["d2t"] = torch.full_like(t["d2t"], token_id)
    t2d = torch.zeros_like(t["t2d"])
    t2d[token_id:token_id + n] = True
    t["t2d"] = t2d
    dst.mkdir(parents=True)
    save_file(t, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    m = json.loads((src / "manifest.json").read_text())
    m["sha256"] = hashlib.sha256((dst / "model.safetensors").read_bytes()).hexdigest()
    m["version"] = dst.name
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def mask_sensitive_head(src: Path, dst: Path, token_id: int = 1, flip_mask: bool = False) -> Path:
    """Copy of ``src`` whose drafts at the parallel (masked) positions are set by ``mask_hidden`` alone:
    the drafter layer adds nothing to its input (attention and MLP outputs zeroed), and the draft is
    ``token_id`` or ``token_id + 1`` by the sign of one feature of that input. At the masked positions
    the input is ``fc(mask_hidden)``, whose feature is positive: ``token_id`` (which the tiny target
    emits often). ``flip_mask`` negates ``mask_hidden``: the same head, drafting ``token_id + 1`` there
    (rarely right). The first position's draft follows the target's hidden state in both."""
    t = load_file(str(src / "model.safetensors"))
    mask = t["mask_hidden"].float().view(-1)
    v = t["fc.weight"].float() @ mask
    j = int(v.abs().argmax())
    sign = 1.0 if v[j] > 0 else -1.0
    for k in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        t[k] = torch.zeros_like(t[k])
    t["norm.weight"] = torch.ones_like(t["norm.weight"])
    lm = torch.zeros_like(t["lm_head.weight"])
    lm[0, j], lm[1, j] = 8.0 * sign, -8.0 * sign
    t["lm_head.weight"] = lm
    n = t["d2t"].numel()
    t["d2t"] = torch.full_like(t["d2t"], token_id)
    t2d = torch.zeros_like(t["t2d"])
    t2d[token_id:token_id + n] = True
    t["t2d"] = t2d
    if flip_mask:
        t["mask_hidden"] = -t["mask_hidden"]
    dst.mkdir(parents=True)
    save_file(t, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    m = json.loads((src / "manifest.json").read_text())
    m["sha256"] = hashlib.sha256((dst / "model.safetensors").read_bytes()).hexdigest()
    m["version"] = dst.name
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def native_fake_replica(first_head: str, k: int = 3, metrics: str = "") -> FastAPI:
    """A stand-in for a dev-mode vLLM replica: the weight-update routes (recorded in ``state.calls``, head
    paths loaded in ``state.loads``, the weight version in ``state.version``), /server_info, /health,
    /metrics and /v1/completions (request headers in ``state.seen``)."""
    app = FastAPI()
    app.state.version, app.state.loads, app.state.calls, app.state.seen = "default", [], [], []

    def step(name: str):
        async def record(req: Request):
            app.state.calls.append(name)
            body = await req.body()
            if name == "update_weights":
                app.state.loads.append(json.loads(body)["update_info"]["path"])
            elif name == "finish_weight_update":
                app.state.version = json.loads(body)["weight_version"]
            return JSONResponse({"success": True} if name == "reset_prefix_cache" else {"ok": name})
        app.post("/" + name)(record)

    for name in ("pause", "start_draft_weight_update", "update_weights", "finish_weight_update", "resume",
                 "reset_prefix_cache"):
        step(name)

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": app.state.version}

    @app.get("/server_info")
    async def server_info():
        return {"vllm_config": {"speculative_config": {"model": first_head, "num_speculative_tokens": k}}}

    @app.post("/weight_checker")
    async def checker():
        return {"checksums": {"model.embed_tokens.weight": "1"}}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(metrics)

    @app.post("/v1/completions")
    async def comp(req: Request):
        app.state.seen.append(dict(req.headers))
        return JSONResponse({"choices": [{"text": "ok"}]})

    return app
