"""`adapt eval` and `adapt head init|import|validate`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from app.common import ConfigOpt, JsonOpt, command_group, emit, fail, get_config
from settings.config import Config


def _target(cfg: Config, target: Optional[Path]) -> Path:
    from targets.model_zoo import ensure_target

    return Path(target) if target else ensure_target(cfg.target.model, cfg.target.model_cache)


def _heldout_rows(cfg: Config, heldout: Optional[Path]) -> list[dict]:
    from evaluation.offline import load_jsonl

    if heldout is not None:
        return load_jsonl(heldout)
    from capture.split import load_split

    return load_split(cfg, "heldout")


TargetOpt = typer.Option(None, "--target", help="Target model dir (default: [target].model).")


def register(app: typer.Typer) -> None:
    head_app = command_group(help="Create, import and check P-EAGLE head directories.")
    app.add_typer(head_app, name="head")

    @app.command("eval")
    def eval_cmd(
        head: Path = typer.Option(..., "--head", help="Head directory."),
        heldout: Optional[Path] = typer.Option(None, "--heldout", help="ShareGPT JSONL (default: the warehouse held-out split)."),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Tokens per prompt (default [bench].max_tokens)."),
        limit: Optional[int] = typer.Option(None, "--limit", help="Evaluate at most this many conversations."),
        target: Optional[Path] = TargetOpt,
        config: ConfigOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Offline acceptance (per position, mean acceptance length) under greedy verification."""
        from evaluation.offline import estimate_acceptance
        from headspec.errors import HeadError

        cfg = get_config(config, json_)
        try:
            rows = _heldout_rows(cfg, heldout)
        except (FileNotFoundError, ValueError) as exc:
            fail(str(exc))
        rows = rows[:limit] if limit else rows
        if not rows:
            fail("no held-out conversations (ingest traffic first, or pass --heldout FILE.jsonl)")
        try:
            res = estimate_acceptance(head, _target(cfg, target), rows,
                                      max_new_tokens=max_new_tokens or cfg.bench.max_tokens,
                                      device=cfg.training.device, progress=True)
        except (HeadError, ValueError) as exc:
            fail(str(exc))
        human = (f"{res['num_prompts']} prompts, {res['num_drafts']} drafts: mean acceptance length "
                 f"{res['mean_acceptance_length']:.3f}, per position "
                 + ", ".join(f"{r:.3f}" for r in res["acceptance_rate_per_pos"]))
        emit(res, json_, human)

    @head_app.command("init")
    def init_cmd(
        out: Path = typer.Option(..., "--out", help="Output head directory."),
        k: Optional[int] = typer.Option(None, "--k", help="Speculative tokens (default [head].num_speculative_tokens)."),
        draft_vocab_size: Optional[int] = typer.Option(None, "--draft-vocab-size"),
        seed: int = typer.Option(0, "--seed"),
        target: Optional[Path] = TargetOpt,
        config: ConfigOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Write a randomly initialised head (embeddings copied from the target)."""
        from adapt.checkpoint import init_random_head
        from headspec.validate import validate_head

        cfg = get_config(config, json_)
        tdir = _target(cfg, target)
        path = init_random_head(tdir, out, k=k or cfg.head.num_speculative_tokens,
                                draft_vocab_size=draft_vocab_size or cfg.head.draft_vocab_size, seed=seed,
                                aux_layer_ids=cfg.head.aux_layer_ids or None, num_layers=cfg.head.num_layers)
        info = validate_head(path, tdir)
        emit(info.to_json(), json_, f"head written to {path} (sha256 {info.sha256[:12]})")

    @head_app.command("import")
    def import_cmd(
        src: Path = typer.Argument(..., help="EAGLE-3 / P-EAGLE head dir (vLLM-style or speculators format)."),
        out: Path = typer.Option(..., "--out", help="Output head directory."),
        k: Optional[int] = typer.Option(None, "--k", help="Override the speculative token count."),
        target: Optional[Path] = TargetOpt,
        config: ConfigOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Normalize a foreign head into a validated head directory with a manifest."""
        from adapt.checkpoint import import_head
        from headspec.errors import HeadError
        from headspec.validate import validate_head

        cfg = get_config(config, json_)
        tdir = _target(cfg, target)
        try:
            path = import_head(src, tdir, out, k=k)
            info = validate_head(path, tdir)
        except HeadError as exc:
            fail(str(exc))
        emit(info.to_json(), json_, f"imported {src} -> {path} (sha256 {info.sha256[:12]})")

    @head_app.command("validate")
    def validate_cmd(
        head: Path = typer.Argument(..., help="Head directory."),
        target: Optional[Path] = TargetOpt,
        config: ConfigOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Check a head is safetensors-only, complete, untampered and fits the target."""
        from headspec.errors import HeadError
        from headspec.validate import validate_head

        cfg = get_config(config, json_)
        try:
            info = validate_head(head, _target(cfg, target))
        except HeadError as exc:
            if json_:
                emit({"ok": False, "error": str(exc)}, True)
                raise typer.Exit(1)
            fail(str(exc))
        emit({"ok": True, **info.to_json()}, json_, f"ok: {head} (sha256 {info.sha256[:12]}, K={info.num_speculative_tokens})")
