"""`adapt eval` and `adapt head init|import|validate`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from app.common import ConfigOpt, ForceOpt, JsonOpt, command_group, emit, error_text, fail, get_config
from settings.config import Config


def _target(cfg: Config, target: Optional[Path]) -> Path:
    from targets.model_zoo import ensure_target

    if target is not None:
        if not (Path(target) / "config.json").is_file():
            fail(f"--target {target} is no model directory (no config.json)", 2)
        return Path(target)
    return ensure_target(cfg.target.model, cfg.target.model_cache)


def _heldout_rows(cfg: Config, heldout: Optional[Path]) -> list[dict]:
    from evaluation.offline import load_jsonl

    if heldout is not None:
        return load_jsonl(heldout)
    from capture.split import load_split

    return load_split(cfg, "heldout")


def _refuse_existing(out: Path, force: bool) -> None:
    """A head directory is replaced only when asked (a head may be what a pool serves)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        fail(f"{out} exists: pass --force to replace it")


TargetOpt = Annotated[Optional[Path], typer.Option("--target", help="Target model dir (default: [target].model).")]
OutOpt = Annotated[Path, typer.Option("--out", help="Output head directory.")]

head_app = command_group(help="Create, import and check P-EAGLE head directories.")


def eval_cmd(
    head: Annotated[Path, typer.Option("--head", help="Head directory.")],
    heldout: Annotated[Optional[Path], typer.Option(
        "--heldout", help="ShareGPT JSONL (default: the warehouse held-out split).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        "--max-new-tokens", min=1, help="Tokens per prompt (default [bench].max_tokens).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Evaluate at most this many conversations.")] = None,
    step_times: Annotated[Optional[Path], typer.Option(
        "--step-times", help="Measured step seconds per batch size and k: a benchmarks/learning_curve.py result "
                             "(its k_choice.step_seconds) or a JSON {\"BxK\": seconds}; prints the K that pays "
                             "at each batch size.")] = None,
    target: TargetOpt = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Offline acceptance (per position, mean acceptance length) under greedy verification."""
    cfg = get_config(config, json_)
    from evaluation.offline import estimate_acceptance
    from headspec.errors import HeadError

    try:
        rows = _heldout_rows(cfg, heldout)
    except (FileNotFoundError, ValueError) as exc:
        fail(error_text(exc))
    rows = rows[:limit] if limit else rows
    if not rows:
        fail("no held-out conversations (ingest traffic first, or pass --heldout FILE.jsonl)")
    try:
        res = estimate_acceptance(head, _target(cfg, target), rows,
                                  max_new_tokens=max_new_tokens or cfg.bench.max_tokens,
                                  device=cfg.training.device, progress=True)
    except (HeadError, ValueError) as exc:
        fail(error_text(exc))
    human = (f"{res['num_prompts']} prompts, {res['num_drafts']} drafts: mean acceptance length "
             f"{res['mean_acceptance_length']:.3f}, per position "
             + ", ".join(f"{r:.3f}" for r in res["acceptance_rate_per_pos"]))
    if step_times is not None:
        res["k_choice"] = _k_choice(head, step_times, res["acceptance_rate_per_pos"], cfg, target)
        human += "\nbest K per batch size: " + ", ".join(
            f"{c['batch_size']}: K={c['k']} ({c['speedup']:.2f}x)" for c in res["k_choice"]["per_batch_size"])
        human += ("\n[serving] num_speculative_tokens_per_batch_size = "
                  + json.dumps([list(r) for r in res["k_choice"]["schedule"]]))
    emit(res, json_, human)


def _k_choice(head: Path, path: Path, rates: list[float], cfg, target: Optional[Path]) -> dict:
    """The best K per batch size from ``path``'s measured step times and this head's per-position acceptance."""
    from evaluation.spec_k import propose_for_head

    try:
        return propose_for_head(rates, path, head, _target(cfg, target)).to_json()
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        fail(f"--step-times {path}: {error_text(exc)}")


@head_app.command("init")
def init_cmd(
    out: OutOpt,
    k: Annotated[Optional[int], typer.Option(
        "--k", min=1, max=16, help="Speculative tokens (default [head].num_speculative_tokens).")] = None,
    draft_vocab_size: Annotated[Optional[int], typer.Option(
        "--draft-vocab-size", min=16, help="Draft vocabulary size (default [head].draft_vocab_size).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
    force: ForceOpt = False,
    target: TargetOpt = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Write a randomly initialised head (embeddings copied from the target)."""
    cfg = get_config(config, json_)
    from adapt.checkpoint import init_random_head
    from headspec.validate import validate_head

    _refuse_existing(out, force)
    tdir = _target(cfg, target)
    path = init_random_head(tdir, out, k=k or cfg.head.num_speculative_tokens,
                            draft_vocab_size=draft_vocab_size or cfg.head.draft_vocab_size, seed=seed,
                            aux_layer_ids=cfg.head.aux_layer_ids or None, num_layers=cfg.head.num_layers)
    info = validate_head(path, tdir)
    emit(info.to_json(), json_, f"head written to {path} (sha256 {info.sha256[:12]})")


@head_app.command("import")
def import_cmd(
    src: Annotated[Path, typer.Argument(help="EAGLE-3 / P-EAGLE head dir (vLLM-style or speculators format).")],
    out: OutOpt,
    k: Annotated[Optional[int], typer.Option("--k", min=1, max=16, help="Override the speculative token count.")] = None,
    force: ForceOpt = False,
    target: TargetOpt = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Normalize a foreign head into a validated head directory with a manifest."""
    cfg = get_config(config, json_)
    from adapt.checkpoint import import_head
    from headspec.errors import HeadError
    from headspec.validate import validate_head

    if not src.is_dir():
        fail(f"no head directory at {src}")
    _refuse_existing(out, force)
    tdir = _target(cfg, target)
    try:
        path = import_head(src, tdir, out, k=k)
        info = validate_head(path, tdir)
    except HeadError as exc:
        fail(error_text(exc))
    emit(info.to_json(), json_, f"imported {src} -> {path} (sha256 {info.sha256[:12]})")


@head_app.command("validate")
def validate_cmd(
    head: Annotated[Path, typer.Argument(help="Head directory.")],
    target: TargetOpt = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Check a head is safetensors-only, complete, untampered and fits the target."""
    cfg = get_config(config, json_)
    from headspec.errors import HeadError
    from headspec.validate import validate_head

    try:
        info = validate_head(head, _target(cfg, target))
    except HeadError as exc:
        if json_:
            emit({"ok": False, "error": str(exc)}, True)
            raise typer.Exit(1)
        fail(error_text(exc))
    emit({"ok": True, **info.to_json()}, json_, f"ok: {head} (sha256 {info.sha256[:12]}, K={info.num_speculative_tokens})")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
    app.add_typer(head_app, name="head")
