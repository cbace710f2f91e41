"""`adapt train`: fine-tune (or bootstrap) a P-EAGLE head on captured traffic."""

from __future__ import annotations

import datetime as _dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from app.common import ConfigOpt, ForceOpt, JsonOpt, emit, error_text, fail, get_config
from settings.config import Config


def _rows(cfg: Config, data: Optional[Path], split: str) -> list[dict]:
    """ShareGPT rows from a JSONL file, else the warehouse split captured so far."""
    from adapt.data import read_sharegpt_jsonl

    if data is not None:
        return read_sharegpt_jsonl(data)
    from capture.split import load_split

    return load_split(cfg, split)


def _offline_estimate(cfg: Config, rows):
    """The exported head's offline acceptance on ``rows``, computed with the target runner training loaded."""
    from evaluation.offline import estimate_acceptance

    def run(head_dir, runner):
        return estimate_acceptance(head_dir, runner.target_dir, rows, max_new_tokens=cfg.bench.max_tokens, runner=runner)

    return run


def torchrun_argv(train_args: list[str], gpus: int, nnodes: int = 1, rdzv_endpoint: str = "",
                  python: str = sys.executable) -> list[str]:
    """``adapt train`` under ``torchrun`` (:func:`adapt.launch.torchrun_prefix`): ``gpus`` ranks on this
    node; with ``nnodes`` > 1, a c10d rendezvous at ``rdzv_endpoint``, where every node runs the same command."""
    from adapt.launch import torchrun_prefix

    return torchrun_prefix(gpus, nnodes, rdzv_endpoint, python) + ["-m", "app", "train", *train_args]


def _launch(args: list[str], gpus: int, nnodes: int, rdzv_endpoint: str) -> None:
    """Run ``adapt train args`` as ``gpus`` x ``nnodes`` ranks and exit with torchrun's status; rank 0
    prints the result."""
    repo = Path(__file__).resolve().parents[2]  # on the ranks' path; they run where this was run
    try:
        argv = torchrun_argv(args, gpus, nnodes, rdzv_endpoint)
    except ValueError as exc:
        fail(str(exc), 2)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    code = subprocess.run(argv, env=env).returncode
    raise typer.Exit(code)


def train_cmd(
    base: Annotated[Optional[str], typer.Option(
        "--base", help="Warm-start head: directory or models:/name/version.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Output head directory (default: a new one in [head].heads_dir).")] = None,
    data: Annotated[Optional[Path], typer.Option(
        "--data", help="ShareGPT JSONL to train on (default: the warehouse train split).")] = None,
    replay: Annotated[Optional[Path], typer.Option(
        "--replay", help="ShareGPT JSONL of older conversations to replay.")] = None,
    eval_data: Annotated[Optional[Path], typer.Option(
        "--eval-data", help="ShareGPT JSONL for offline acceptance (default: held-out split when --data is not given).")] = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", min=0, help="Override [training].max_steps.")] = None,
    max_minutes: Annotated[Optional[float], typer.Option(
        "--max-minutes", min=0, help="Override [training].max_minutes.")] = None,
    gpus: Annotated[int, typer.Option(
        "--gpus", min=1, help="Data-parallel ranks on this node, one per GPU (gloo ranks on a CPU): above 1, "
                              "`adapt train` runs itself under torchrun.")] = 1,
    nnodes: Annotated[int, typer.Option(
        "--nnodes", min=1, help="Nodes, each running this same command (needs --rdzv-endpoint).")] = 1,
    rdzv_endpoint: Annotated[str, typer.Option(
        "--rdzv-endpoint", help="HOST:PORT of the rendezvous for several nodes (torchrun's c10d).")] = "",
    force: ForceOpt = False,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Train a head; prints its directory, steps, tokens/s, final loss per depth and offline acceptance."""
    cfg = get_config(config, json_)
    from adapt.train import ShapeChangeError, train

    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        fail(f"{out} exists: pass --force to replace it")
    launched = "WORLD_SIZE" in os.environ  # a rank torchrun started (this command, or a user's torchrun)
    if (gpus > 1 or nnodes > 1) and not launched:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        # One output directory for every rank, named here (each rank's clock would name its own).
        args = ["--out", str((out or Path(cfg.head.heads_dir) / f"head-{stamp}").absolute())]
        for flag, value in (("--base", base), ("--data", data), ("--replay", replay), ("--eval-data", eval_data),
                            ("--max-steps", max_steps), ("--max-minutes", max_minutes), ("--config", config)):
            if value is not None:
                args += [flag, str(value)]
        args += ["--force"] * force + ["--json"] * json_
        _launch(args, gpus, nnodes, rdzv_endpoint)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if max_steps is not None:
        cfg.training.max_steps = max_steps
    if max_minutes is not None:
        cfg.training.max_minutes = max_minutes
    try:
        rows = _rows(cfg, data, "train")
        replay_rows = _rows(cfg, replay, "train") if replay else None
        if eval_data is not None:
            eval_rows = _rows(cfg, eval_data, "heldout")
        else:
            eval_rows = None if data is not None else _rows(cfg, None, "heldout")
    except (FileNotFoundError, ValueError) as exc:
        fail(error_text(exc))
    if not rows:
        fail("no training conversations (ingest traffic first, or pass --data FILE.jsonl)")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = out or Path(cfg.head.heads_dir) / f"head-{stamp}"
    try:
        res = train(cfg, rows, base, out_dir, replay_rows, progress=not json_,
                    after_export=_offline_estimate(cfg, eval_rows) if eval_rows else None)
    except (ShapeChangeError, FileNotFoundError, ValueError) as exc:
        fail(error_text(exc))
    obj = {
        "out_dir": res.out_dir,
        "steps": res.steps,
        "tokens": res.tokens,
        "tokens_per_s": res.tokens_per_s,
        "final_depth_loss": res.final_depth_loss,
        "final_depth_acc": res.final_depth_acc,
        "parent_sha": res.parent_sha,
        "data_snapshot": res.data_snapshot,
        "num_examples": res.num_examples,
        "acceptance": res.acceptance,
    }
    human = (f"head: {res.out_dir}\nsteps: {res.steps}  tokens/s: {res.tokens_per_s}\n"
             f"loss per depth: {[round(x, 4) for x in res.final_depth_loss]}\n"
             f"top-1 per depth: {[round(x, 3) for x in res.final_depth_acc]}\n"
             f"offline acceptance: {res.acceptance}")
    if main_rank:  # under torchrun every rank trains, rank 0 answers
        emit(obj, json_, human=human)


def register(app: typer.Typer) -> None:
    app.command("train")(train_cmd)
