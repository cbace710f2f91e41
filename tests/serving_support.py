"""Shared by the serving tests (a support module: no test module imports another): the heads they swap,
a fake replica that stands in for vLLM, and the router served on loopback in front of replicas."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from safetensors.torch import load_file, save_file

from tests.services import free_port


# -- heads -------------------------------------------------------------------------------------

def _draft_always(t: dict[str, torch.Tensor], token_id: int) -> None:
    """Map the draft vocab onto ``token_id``, ``token_id + 1``, ...: with tied draft logits vLLM's argmax
    takes the smallest target id among them, ``token_id``."""
    n = t["d2t"].numel()
    t["d2t"] = torch.full_like(t["d2t"], token_id)
    t2d = torch.zeros_like(t["t2d"])
    t2d[token_id:token_id + n] = True
    t["t2d"] = t2d


def _save_variant(t: dict[str, torch.Tensor], src: Path, dst: Path) -> Path:
    """``src``'s config and manifest with the tensors ``t``, its sha256 and version (``dst.name``) its own."""
    dst.mkdir(parents=True)
    save_file(t, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    m = json.loads((src / "manifest.json").read_text())
    m["sha256"] = hashlib.sha256((dst / "model.safetensors").read_bytes()).hexdigest()
    m["version"] = dst.name
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def constant_token_head(src: Path, dst: Path, token_id: int) -> Path:
    """Copy of ``src`` whose draft is always ``token_id``: final norm zeroed, draft vocab mapped so the
    draft is always that token (the tiny target emits token 1 often): non-zero acceptance, and two such
    heads from different random heads behave alike with different weights and sha256."""
    t = load_file(str(src / "model.safetensors"))
    t["norm.weight"] = torch.zeros_like(t["norm.weight"])  # all draft logits tie at 0
    _draft_always(t, token_id)
    return _save_variant(t, src, dst)


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
    _draft_always(t, token_id)
    if flip_mask:
        t["mask_hidden"] = -t["mask_hidden"]
    return _save_variant(t, src, dst)


def make_heads(tiny_model: Path, d: Path) -> dict[str, Path]:
    """The heads the serving tests swap, all for the tiny target (K=3 unless named otherwise):

    * ``r0``/``r1``/``r2``: untrained random heads (acceptance ~0);
    * ``e0``/``e1``/``e2``: "constant-token" heads made from them (:func:`constant_token_head`, token 1):
      non-zero acceptance, identical behaviour, different weights and sha256;
    * ``mA``/``mB``: heads whose parallel (masked) drafts are set by ``mask_hidden`` alone; they differ
      only in it (:func:`mask_sensitive_head`);
    * ``k2``: a random head with K=2; ``v128``: a constant-token head with another draft vocabulary size
      (neither can be swapped in place);
    * ``corrupt``: ``e1`` with a flipped byte (its manifest's sha256 no longer matches);
    * ``foreign``: a head for another target.
    """
    from adapt.checkpoint import init_random_head
    from targets.model_zoo import build_tiny_llama

    h = {f"r{s}": init_random_head(tiny_model, d / f"r{s}", k=3, seed=s, draft_vocab_size=256) for s in (0, 1, 2)}
    for s in (0, 1, 2):
        h[f"e{s}"] = constant_token_head(h[f"r{s}"], d / f"e{s}", 1)
    h["mA"] = mask_sensitive_head(h["r0"], d / "mA")
    h["mB"] = mask_sensitive_head(h["r0"], d / "mB", flip_mask=True)
    h["k2"] = init_random_head(tiny_model, d / "k2", k=2, seed=2, draft_vocab_size=256)
    h["v128"] = constant_token_head(init_random_head(tiny_model, d / "r128", k=3, seed=3, draft_vocab_size=128),
                                    d / "v128", 1)
    corrupt = d / "corrupt"
    shutil.copytree(h["e1"], corrupt)
    blob = bytearray((corrupt / "model.safetensors").read_bytes())
    blob[-3] ^= 0xFF  # one flipped bit pattern in the last tensor's data
    (corrupt / "model.safetensors").write_bytes(bytes(blob))
    h["corrupt"] = corrupt
    other = build_tiny_llama(d / "other-target", hidden_size=64, intermediate_size=128)
    h["foreign"] = init_random_head(other, d / "foreign", k=3, seed=4, draft_vocab_size=256)
    return h


# -- a fake replica ----------------------------------------------------------------------------

def fake_replica(text: str = "ok", *, delay: float = 0.0, fail_every: int = 0, context_chars: int | None = None,
                 metrics: str = "") -> FastAPI:
    """A stand-in for a vLLM replica, served with ``tests.services.LoopbackServer``.

    /health, /v1/models, /metrics (``metrics``) and the OpenAI routes:

    * /v1/completions answers ``text`` after ``delay`` s, or a stream of three chunks;
    * /v1/chat/completions answers turn n of a conversation with "answer-<n>" after ``delay`` s, and
      refuses a history over ``context_chars`` characters as vLLM does (400, "maximum context length");
    * with ``fail_every`` = n, every n-th request to either answers 503.

    ``state.hits`` counts those requests, ``state.seen`` holds each one's ``path``, ``headers``, raw
    ``body`` and parsed ``json``; ``state.in_flight``/``state.peak`` count chat requests in flight.
    """
    app = FastAPI()
    app.state.hits, app.state.seen, app.state.in_flight, app.state.peak = 0, [], 0, 0

    async def arrive(req: Request) -> tuple[dict, JSONResponse | None]:
        body = await req.body()
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        app.state.hits += 1
        app.state.seen.append({"path": req.url.path, "headers": dict(req.headers), "body": body, "json": parsed})
        if fail_every and app.state.hits % fail_every == 0:
            return parsed, JSONResponse({"error": "overloaded"}, status_code=503)
        return parsed, None

    def stream() -> StreamingResponse:
        async def gen():
            for w in ("a", "b", "c"):
                yield f"data: {json.dumps({'choices': [{'text': w}]})}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "tiny"}]}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(metrics)

    @app.post("/v1/completions")
    async def completions(req: Request):
        body, refused = await arrive(req)
        if refused:
            return refused
        if body.get("stream"):
            return stream()
        await asyncio.sleep(delay)
        return JSONResponse({"choices": [{"text": text}], "usage": {"completion_tokens": 1}})

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        body, refused = await arrive(req)
        if refused:
            return refused
        messages = body.get("messages") or []
        if context_chars is not None and sum(len(m["content"]) for m in messages) > context_chars:
            return JSONResponse({"error": {"message": "This model's maximum context length is 2048 tokens"}}, 400)
        if body.get("stream"):
            return stream()
        app.state.in_flight += 1
        app.state.peak = max(app.state.peak, app.state.in_flight)
        await asyncio.sleep(delay)
        app.state.in_flight -= 1
        n = sum(m["role"] == "user" for m in messages)
        return {"choices": [{"message": {"role": "assistant", "content": f"answer-{n}"}}],
                "usage": {"completion_tokens": 3}}

    return app


class FakeWeightSync:
    """vLLM's weight-update protocol as an engine in the agent's process offers it
    (``serving.admin.WeightSync``), launched with ``first_head``: each step recorded in ``calls``, head
    paths loaded in ``loads``, the weight version in ``version``; ``fail`` names a step that raises."""

    url = "engine"

    def __init__(self, first_head: str, k: int = 3, fail: str | None = None) -> None:
        self.first_head, self.k, self.fail = first_head, k, fail
        self.version, self.loads, self.calls = "default", [], []

    async def _step(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            from serving.admin import RpcError

            raise RpcError(f"engine: {name}: injected")

    async def pause(self) -> None:
        await self._step("pause")

    async def start_draft(self) -> None:
        await self._step("start_draft_weight_update")

    async def update(self, update_info: dict) -> None:
        await self._step("update_weights")
        self.loads.append(update_info["path"])

    async def finish(self, weight_version: str) -> None:
        await self._step("finish_weight_update")
        self.version = weight_version

    async def resume(self) -> None:
        await self._step("resume")

    async def reset_prefix_cache(self) -> None:
        await self._step("reset_prefix_cache")

    async def weight_version(self) -> str:
        return self.version

    async def launch_spec(self) -> dict:
        return {"model": self.first_head, "num_speculative_tokens": self.k}

    async def target_checksums(self) -> dict[str, str]:
        return {"model.embed_tokens.weight": "1"}


# -- the router on loopback --------------------------------------------------------------------

class Router:
    """The router app, served as in production (``serving.router.server_config``) on loopback, in a
    thread with its own loop, over a pool of ``replica_urls`` (``pool.replicas`` in that order). With
    ``capture_dir``, a capture writer (endpoint "ep") records what it serves, flushed when it stops."""

    def __init__(self, replica_urls: str | list[str], *, capture_dir: Path | None = None, admin_token: str = "",
                 header_timeout: float | None = None, body_timeout: float | None = None, **app_kw):
        from serving.pool import Pool

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pool = Pool(health_interval=0.2)
        for u in [replica_urls] if isinstance(replica_urls, str) else replica_urls:
            self.pool.attach(u)
        self.capture_dir, self.admin_token, self.app_kw = capture_dir, admin_token, app_kw
        self.deadlines = {k: v for k, v in (("header_timeout", header_timeout), ("body_timeout", body_timeout))
                          if v is not None}
        self.srv: uvicorn.Server | None = None

    def __enter__(self) -> "Router":
        from serving.capture_writer import CaptureWriter
        from serving.router import create_app, server_config

        def run():
            async def main():
                writer = (CaptureWriter(str(self.capture_dir), "ep", flush_seconds=0.05)
                          if self.capture_dir is not None else None)
                await self.pool.start_background()
                app = create_app(self.pool, writer=writer, admin_token=self.admin_token, **self.app_kw)
                srv = uvicorn.Server(server_config(app, "127.0.0.1", self.port, log_level="error", **self.deadlines))
                srv.install_signal_handlers = lambda: None
                self.srv = srv
                await srv.serve()
                if writer is not None:
                    await writer.close()
                await self.pool.close()
            asyncio.run(main())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        for _ in range(300):
            if self.srv is not None and self.srv.started:
                return self
            time.sleep(0.02)
        raise RuntimeError("router did not start")

    def __exit__(self, *exc) -> None:
        if self.srv is not None:
            self.srv.should_exit = True
        self.thread.join(20)
