"""One adaptation cycle as resumable steps.

ingest → snapshot → base → train → evaluate → bench → gate → log_run → register → promote

Each step's small output (ids, paths, verdicts) is recorded in
``<state_dir>/cycles/<cycle_id>/state.json`` as soon as it finishes; a re-run of
the same cycle skips recorded steps and continues with the first missing one, so
a crash anywhere costs at most the step it interrupted. Steps that create
something outside the cycle directory are idempotent on their own: the MLflow run
is found by its ``adapt.cycle_id`` tag and the model version by its run, so even a
crash between creating a version and recording it never yields a second version.

Airflow tasks call :func:`run_step` with nothing but the cycle id; the CLI and
tests call :func:`run_cycle`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from loop import gate as gate_mod
from loop import tracking
from loop.steps import STEPS
from loop.store import CycleStore, relative_paths
from rollout import registry as reg_mod
from settings.config import Config

log = logging.getLogger("loop.cycle")

# fault(point) is called at named points; tests use it to kill the process mid-cycle.
Fault = Callable[[str], None]


class CycleError(RuntimeError):
    """A step cannot run (no data, no head, ...); the message says why."""


@dataclass
class CycleOptions:
    """What a cycle needs beyond the config (none of it changes what is trained)."""

    live_head: str | None = None  # live head when no version is in Production yet
    bench_url: str | None = None  # an existing bench replica (default: start one)
    nospec_url: str | None = None  # an existing replica without speculation (the bench's reference arm)
    # The scheduler's data interval (ISO times): ingest reads these layout hours (plus capture.late_hours).
    data_interval: tuple[str, str] | None = None
    router_url: str | None = None  # swap the pool after promotion (default: leave it to the controller)
    # Train and evaluate in a child process each (loop.step_worker): what they grow (the target in fp32,
    # oneDNN's kernels per batch shape, the allocator's arenas) goes back to the machine when the step
    # ends, instead of staying in this process beside the engines for the rest of its life.
    step_processes: bool = False
    fault: Fault | None = None
    progress: Callable[[str], None] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"live_head": self.live_head, "bench_url": self.bench_url, "nospec_url": self.nospec_url,
                "router_url": self.router_url, "data_interval": list(self.data_interval) if self.data_interval else None}


# --- state ---------------------------------------------------------------------------

class Cycle:
    """What every step of a cycle works with, built once per cycle: the config, the store, the registry."""

    def __init__(self, cfg: Config, store: CycleStore | None = None) -> None:
        self.cfg = cfg
        self.store = store or CycleStore(cfg)
        self._registry: reg_mod.Registry | None = None

    @property
    def registry(self) -> reg_mod.Registry:
        """The MLflow registry (connected on first use: most steps never need it)."""
        if self._registry is None:
            self._registry = reg_mod.Registry(self.cfg)
        return self._registry

    def dir(self, cycle_id: str) -> Path:
        """This worker's work directory for ``cycle_id``."""
        return self.store.local_dir(cycle_id)

    def load_state(self, cycle_id: str) -> dict[str, Any]:
        self.store.local_dir(cycle_id)  # validates the id
        return self.store.read_state(cycle_id) or {"cycle_id": cycle_id, "created_at": _now(), "steps": {},
                                                   "options": {}}

    def save_state(self, state: dict[str, Any]) -> None:
        state["updated_at"] = _now()
        self.store.write_state(state)

    def local(self, state: dict[str, Any], path: str | None) -> Path | None:
        """A path a step recorded, on this worker: relative ones are fetched from the store if missing here."""
        return None if path is None else self.store.pull(state["cycle_id"], path)


def new_cycle_id() -> str:
    return "c" + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def cycle_dir(cfg: Config, cycle_id: str) -> Path:
    """This worker's work directory for ``cycle_id``."""
    return Cycle(cfg).dir(cycle_id)


def load_state(cfg: Config, cycle_id: str) -> dict[str, Any]:
    """The cycle's recorded state (from the shared store when there is one), or a new one."""
    return Cycle(cfg).load_state(cycle_id)


def save_state(cfg: Config, state: dict[str, Any]) -> None:
    Cycle(cfg).save_state(state)


def local(cfg: Config, state: dict[str, Any], path: str | None) -> Path | None:
    """A path a step recorded, on this worker: relative ones are fetched from the store if missing here."""
    return Cycle(cfg).local(state, path)


def latest_unfinished(cfg: Config) -> str | None:
    """The newest cycle that has not recorded its last step (what ``adapt cycle`` resumes)."""
    store = CycleStore(cfg)
    for cid in reversed(store.cycle_ids()):
        st = store.read_state(cid) or {}
        if STEPS[-1] not in st.get("steps", {}):
            return cid
    return None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _target(cfg: Config) -> Path:
    from targets.model_zoo import ensure_target

    return ensure_target(cfg.target.model, cfg.target.model_cache)


def _out(state: dict[str, Any], step: str) -> dict[str, Any]:
    try:
        return state["steps"][step]
    except KeyError:
        raise CycleError(f"step {step!r} has not run in cycle {state['cycle_id']}") from None


def _jsonable(v: Any) -> Any:
    if isinstance(v, (_dt.datetime, _dt.date)):
        return v.isoformat()
    return v


def _read_rows(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# --- steps ---------------------------------------------------------------------------

def step_ingest(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    """New capture into the warehouse: everything new, or the scheduler's data interval (plus late hours)."""
    from capture.ingest import ingest

    cfg = cx.cfg
    if not opts.data_interval:
        return ingest(cfg).summary()
    start, end = (_dt.datetime.fromisoformat(t) for t in opts.data_interval)
    since = start - _dt.timedelta(hours=cfg.capture.late_hours)
    out = ingest(cfg, since=since, until=end).summary()
    out["interval"] = [since.isoformat(), end.isoformat()]
    return out


def step_snapshot(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    """Freeze both splits as Parquet in the cycle directory: later steps never see newer traffic.

    The held-out rows the evaluation and the bench replay (``heldout.jsonl``) leave out
    every conversation whose user question repeats a training prompt
    (``capture.overlap``) when ``[bench] exclude_train_overlap`` is on; the count is
    recorded either way.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    cfg = cx.cfg
    from capture.overlap import drop_repeats
    from capture.split import split_table

    d = cx.dir(state["cycle_id"])
    table = split_table(cfg)
    out: dict[str, Any] = {}
    for split in ("train", "heldout"):
        t = table.filter(pc.equal(table.column("split"), split)) if table.num_rows else table
        if t.num_rows == 0:
            raise CycleError(f"no {split} conversations in the warehouse: ingest more traffic first")
        hashes = sorted(t.column("content_hash").to_pylist())
        sid = hashlib.sha256("\n".join(hashes).encode()).hexdigest()
        path = d / f"{split}.parquet"
        tmp = d / f".{split}.parquet.tmp"
        pq.write_table(t, tmp)
        os.replace(tmp, path)
        out[split] = {"path": path.name, "id": sid, "rows": t.num_rows}
    # The replay benchmark reads ShareGPT JSONL.
    held = _read_rows(d / out["heldout"]["path"])
    kept, rep = drop_repeats(_read_rows(d / out["train"]["path"]), held)
    rep["excluded"] = cfg.bench.exclude_train_overlap
    if not cfg.bench.exclude_train_overlap:
        kept = held
    if not kept:
        raise CycleError(f"all {len(held)} held-out conversations repeat a training prompt: nothing new to measure on")
    jl = d / "heldout.jsonl"
    with open(jl.with_suffix(".tmp"), "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps({k: _jsonable(v) for k, v in r.items()}, ensure_ascii=False) + "\n")
    os.replace(jl.with_suffix(".tmp"), jl)
    out["heldout"]["jsonl"] = jl.name
    out["heldout"]["measured_rows"] = len(kept)
    out["heldout_overlap"] = rep
    return out


def step_base(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    """The parent (current Production head; None = bootstrap) and the live head to benchmark against."""
    from headspec.validate import validate_head

    cfg = cx.cfg
    reg = cx.registry
    prod = reg.production()
    d = cx.dir(state["cycle_id"])
    if prod is not None:
        path = reg.download_head(prod.version, d / "parent")
        sha = validate_head(path, _target(cfg)).sha256
        rel = cx.store.rel(state["cycle_id"], path)
        return {"parent_version": prod.version, "parent_path": rel, "parent_sha256": sha,
                "live_version": prod.version, "live_path": rel, "live_sha256": sha}
    live = opts.live_head
    if live is None:
        cur = Path(cfg.head.heads_dir) / "current"
        live = str(cur.resolve()) if (cur / "config.json").is_file() else None
    if not live:
        return {"parent_version": None, "parent_path": None, "parent_sha256": None,
                "live_version": None, "live_path": None, "live_sha256": None}
    # A copy in the cycle directory: the bench step may run on a worker without this one's heads.
    copy = d / "live"
    if not (copy / "config.json").is_file():
        tmp = d / ".live.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(live, tmp)
        os.replace(tmp, copy)
    live_sha = validate_head(copy, _target(cfg)).sha256
    return {"parent_version": None, "parent_path": None, "parent_sha256": None,
            "live_version": None, "live_path": "live", "live_sha256": live_sha}


def step_train(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    """A head trained on the train snapshot from the parent (or from scratch): here, or in a child process;
    with ``[training] gpus`` above 1, in that many ranks under torchrun (data parallel, one per GPU)."""
    ranks = cx.cfg.training.gpus
    if ranks > 1:
        return in_own_process("train", cx, state, ranks=ranks)
    return in_own_process("train", cx, state) if opts.step_processes else train_here(cx, state)


def train_here(cx: Cycle, state: dict[str, Any]) -> dict[str, Any]:
    from adapt.data import split_new
    from adapt.launch import launched_rank
    from adapt.train import train
    from headspec.files import read_manifest
    from headspec.validate import validate_head

    cfg = cx.cfg
    d = cx.dir(state["cycle_id"])
    snap, base = _out(state, "snapshot"), _out(state, "base")
    rows = _read_rows(cx.local(state, snap["train"]["path"]))
    parent = cx.local(state, base["parent_path"])
    # A fine-tune trains on the traffic since its parent's data, plus a [training] replay_ratio share
    # of what came before: the whole history every night would dilute a drift more every night.
    new, old = split_new(rows, read_manifest(parent).get("data_snapshot") if parent else None)
    # The checkpoint in head.run makes an interrupted training resume where it stopped (on this worker).
    res = train(cfg, new, str(parent) if parent else None, d / "head", old, run_dir=d / "head.run",
                target_dir=_target(cfg), progress=False)
    if launched_rank():  # under torchrun every rank trains; rank 0 writes what the step answers
        return {}
    (d / "train.json").write_text(json.dumps(res.to_json(), indent=1, default=str))
    info = validate_head(res.out_dir, _target(cfg))
    return {"head_path": "head", "head_sha256": info.sha256, "num_speculative_tokens": info.num_speculative_tokens,
            "steps": res.steps, "tokens": res.tokens, "tokens_per_s": res.tokens_per_s,
            "final_depth_loss": res.final_depth_loss, "final_depth_acc": res.final_depth_acc,
            "data_snapshot": res.data_snapshot, "train_json": "train.json", "new_rows": len(new),
            "older_rows": len(old), "examples": res.num_examples}


def step_evaluate(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    """Offline acceptance of the candidate and the live head on the held-out snapshot, and the pre-screen.

    It runs only where it can change a decision: with no live head (bootstrap) nothing is
    compared, and with ``[gate] offline_prescreen`` off the bench decides alone. The target's
    greedy answers are computed once for both heads (``evaluation.offline.compare_heads``);
    a candidate confidently not better in offline acceptance is rejected here
    (``loop.gate.prescreen``), and the bench step does not run. The evaluation runs in a child
    process with ``opts.step_processes``.
    """
    base = _out(state, "base")
    if not base["live_path"]:
        return {"skipped": "no live head to compare against (bootstrap)"}
    if not cx.cfg.gate.offline_prescreen:
        return {"skipped": "[gate] offline_prescreen is off: the replay benchmark decides alone"}
    return in_own_process("evaluate", cx, state) if opts.step_processes else evaluate_here(cx, state)


def evaluate_here(cx: Cycle, state: dict[str, Any]) -> dict[str, Any]:
    from evaluation.offline import compare_heads, load_jsonl

    cfg = cx.cfg
    snap, base, tr = _out(state, "snapshot"), _out(state, "base"), _out(state, "train")
    rows = load_jsonl(cx.local(state, snap["heldout"]["jsonl"]))  # the held-out rows the bench replays
    out: dict[str, Any] = compare_heads({"candidate": cx.local(state, tr["head_path"]),
                                         "live": cx.local(state, base["live_path"])},
                                        _target(cfg), rows, max_new_tokens=cfg.bench.max_tokens,
                                        device=cfg.training.device)
    verdict = gate_mod.prescreen(out, cfg.gate)
    # the check a rejection read (at a bench look's level where the futility rule refused), else the gate's
    out["check"] = (verdict.checks[0] if verdict else gate_mod.offline_check(out, cfg.gate)).to_json()
    out["prescreen"] = verdict.to_json() if verdict else None
    if cfg.bench.step_times:
        out["k_proposal"] = k_proposal(cfg, cx.local(state, tr["head_path"]),
                                       out["candidate"]["acceptance_rate_per_pos"]).to_json()
    d = cx.dir(state["cycle_id"])
    (d / "offline_eval.json").write_text(json.dumps(out, indent=1, default=str))
    out["json_path"] = "offline_eval.json"
    return out


# What a step run in its own process sets in its environment (the caller's own values win).
# oneDNN keeps a kernel for every shape it has run (1,024 by default), and training meets a new
# batch shape at almost every step: a short cache keeps the trainer's memory from growing with the
# shapes it has seen, at the cost of rebuilding a kernel for a shape that comes back (docs/benchmarks.md).
STEP_ENV: dict[str, dict[str, str]] = {"train": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8"}}
IN_PROCESS: dict[str, Callable[[Cycle, dict[str, Any]], dict[str, Any]]] = {}  # filled below the steps
# Where torchrun's ranks of a step find the config (JSON), in place of their stdin.
CONFIG_ENV = "ADAPT_STEP_CONFIG_JSON"
_REPO_ROOT = Path(__file__).resolve().parents[1]


def in_own_process(step: str, cx: Cycle, state: dict[str, Any], ranks: int = 1) -> dict[str, Any]:
    """Run ``step``'s work in ``python -m loop.step_worker`` and return its output; with ``ranks`` above 1,
    in that many workers under torchrun (:func:`adapt.launch.torchrun_prefix`, as `adapt train
    --gpus` starts them), rank 0's output.

    The config goes to the child on its stdin (it holds secrets: never on its command line or on
    disk), or, to torchrun's ranks, which share no stdin, in their environment (:data:`CONFIG_ENV`:
    readable by this user alone, as the stdin pipe is); the child reads the cycle's recorded state
    from the store as this process wrote it before the step, and writes its output to a file this
    process reads and removes. Its output (logs, a traceback) goes to ``<step>.log`` in the cycle
    directory; a failure raises :class:`CycleError` with the log's last lines.
    """
    import subprocess
    import sys

    d = cx.dir(state["cycle_id"])
    out_path, log_path = d / f".{step}.out.json", d / f"{step}.log"
    out_path.unlink(missing_ok=True)
    env = dict(os.environ)
    for k, v in STEP_ENV.get(step, {}).items():
        env.setdefault(k, v)
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                            if p and p != str(_REPO_ROOT)]])
    cmd = [sys.executable, "-m", "loop.step_worker", step, state["cycle_id"], str(out_path)]
    stdin: bytes | None = cx.cfg.model_dump_json().encode()
    if ranks > 1:
        from adapt.launch import torchrun_prefix

        cmd = torchrun_prefix(ranks) + cmd[1:]
        env[CONFIG_ENV], stdin = stdin.decode(), None
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            proc.communicate(stdin)
        except BaseException:  # interrupted here: the child does not outlive the step
            proc.kill()
            proc.wait()
            raise
    if proc.returncode != 0 or not out_path.is_file():
        lines = log_path.read_text(errors="replace").splitlines()
        tail = lines[-15:]
        if ranks > 1:  # torchrun's own summary ends the log: put the ranks' exceptions first
            raised = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception): ", ln)]
            tail = list(dict.fromkeys(raised))[-5:] + tail
        raise CycleError(f"step {step!r} in its own process exited with code {proc.returncode} "
                         f"({log_path}):\n" + "\n".join(tail))
    out = json.loads(out_path.read_text())
    out_path.unlink()
    return out


def k_proposal(cfg: Config, head_dir: Path, rate_per_pos: list[float]):
    """The K per batch size a head with ``rate_per_pos`` supports on the target ([bench] step_times)."""
    from evaluation.spec_k import propose_for_head

    try:
        return propose_for_head(rate_per_pos, cfg.bench.step_times, head_dir, _target(cfg))
    except (OSError, ValueError, KeyError) as exc:
        raise CycleError(f"[bench] step_times {cfg.bench.step_times}: {exc}") from exc


def step_bench(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    """Replay the held-out traffic and decide: candidate vs live (with the A/A control), re-measured while inconclusive.

    Attempt n replays the n-th batch of ``[bench] max_prompts`` held-out prompts (new prompt
    groups while the held-out set has them, else the same ones again) in another
    counterbalanced order (its own seed, drawn from the cycle's id), is kept in
    ``bench-<n>/``, and is pooled with the earlier ones; the gate
    (``loop.gate.decide``) looks at the pool after each attempt, at the level that keeps
    the false-promotion rate of all ``max_attempts`` looks together at ``[gate]``'s. The
    verdict is recorded here, and the gate step takes it as it is. A re-run of this step
    reuses attempts already written.

    The no-speculation reference arm (with ``opts.nospec_url``) runs in the first attempt
    only (and in its first round): the gate does not read it, so a repeat, which exists to
    narrow the gate's intervals, would spend a quarter of its slots on a figure already measured.
    An attempt runs no more rounds once the candidate passed the look after its first round
    (``[gate] first_round_share``) or acceptance cannot pass (:func:`loop.gate.round_look`).
    """
    from evaluation.bench import BenchPlan, bench_heads, heldout_batches
    from evaluation.result import BenchResult

    cfg = cx.cfg
    snap, base, tr = _out(state, "snapshot"), _out(state, "base"), _out(state, "train")
    if not base["live_path"]:
        return {"skipped": "no live head to compare against (bootstrap)"}
    rejected = (state["steps"].get("evaluate") or {}).get("prescreen")
    if rejected:
        return {"skipped": "the offline pre-screen rejected the candidate", "verdict": rejected}
    d = cx.dir(state["cycle_id"])
    results: list[BenchResult] = []
    attempts = []
    measured = snap["heldout"].get("measured_rows")
    available = int(measured or cfg.bench.max_prompts)
    size = gate_mod.size_attempts(_recent_benches(cx, state), cfg.gate, cfg.bench, available)
    for n in range(1, cfg.gate.max_attempts + 1):
        try:  # an attempt already written (here or by another worker) is not measured again
            res = BenchResult.load(cx.local(state, f"bench-{n}/bench.json"))
        except FileNotFoundError:
            if opts.progress:
                opts.progress(f"bench attempt {n} of at most {cfg.gate.max_attempts}")
            res = bench_heads(cfg, BenchPlan(
                candidate=str(cx.local(state, tr["head_path"])), live=str(cx.local(state, base["live_path"])),
                heldout=str(cx.local(state, snap["heldout"]["jsonl"])), out=d / f"bench-{n}", url=opts.bench_url,
                nospec=(bool(opts.nospec_url) or None) if n == 1 else False, nospec_url=opts.nospec_url,
                seed=cfg.bench.seed + n - 1, cycle=state["cycle_id"], prompt_batch=n - 1,
                max_prompts=size.prompts, rounds=size.rounds, group_size=size.group_size,
                prompts_at=size.prompts_at or None, heldout_overlap=snap.get("heldout_overlap"),
                stop_after_round=lambda partial: gate_mod.round_look(results + [partial], cfg.gate)),
                progress=opts.progress)
        results.append(res)
        # attempt n + 1 replays batch n: new prompt groups only while the held-out set has more batches
        more = measured is None or n < heldout_batches(int(measured), size.prompts)
        verdict = gate_mod.decide(results, cfg.gate, more_prompts=more)
        attempts.append({"attempt": n, "json_path": f"bench-{n}/bench.json", "verdict": verdict.status,
                         "voided": n in verdict.voided, "summary": res.headline()})
        if verdict.status != gate_mod.INCONCLUSIVE or verdict.final:
            break
    n = attempts[-1]["attempt"]
    # The speed-up over no speculation: the newest attempt that measured it, side by side with its arms.
    ref = next((a["json_path"] for a, r in zip(reversed(attempts), reversed(results)) if r.speedup_vs_nospec), None)
    return {"json_path": f"bench-{n}/bench.json", "plot_path": f"bench-{n}/bench.png", "dir_path": f"bench-{n}",
            "nospec_json_path": ref,
            "requests": results[-1].requests, "summary": attempts[-1]["summary"], "attempts": attempts,
            "size": size.to_json(), "verdict": verdict.to_json()}


def _recent_benches(cx: Cycle, state: dict[str, Any], cycles: int = 3) -> list:
    """The bench results of the last ``cycles`` cycles before this one that benchmarked: their noise sizes this one's."""
    from evaluation.result import BenchResult

    out: list = []
    for cid in reversed([c for c in cx.store.cycle_ids() if c < state["cycle_id"]]):
        st = cx.store.read_state(cid) or {}
        paths = [a.get("json_path") for a in ((st.get("steps") or {}).get("bench") or {}).get("attempts") or []]
        got = []
        for path in paths:
            try:
                got.append(BenchResult.load(cx.local(st, path)))
            except (OSError, ValueError, KeyError):  # gone or unreadable: that bench sizes nothing
                continue
        out += got
        cycles -= bool(got)
        if cycles <= 0:
            break
    return out


def step_gate(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    """The verdict the bench step decided (one decision per cycle), or the bootstrap's."""
    b = _out(state, "bench")
    if b.get("verdict"):
        return dict(b["verdict"])
    if b.get("skipped"):
        return gate_mod.bootstrap_verdict().to_json()
    return dict(b["verdict"])


def step_log_run(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    """The reviewer's files on the cycle's MLflow run (its figures were logged step by step)."""
    return tracking.CycleRun(cx.cfg, state, cx.registry, cx.store).artifacts()


def step_register(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    reg = cx.registry
    run = _out(state, "log_run")
    base, tr, g = (state["steps"][s] for s in ("base", "train", "gate"))
    tags = {reg_mod.T_SHA: tr["head_sha256"], reg_mod.T_K: tr["num_speculative_tokens"],
            reg_mod.T_PARENT: base["parent_version"] or "none", reg_mod.T_GATE: g["verdict"],
            reg_mod.T_REASON: g["reason"][:4900], reg_mod.T_CYCLE: state["cycle_id"]}
    speedup = speedup_vs_nospec(cx, state)
    if speedup:
        tags[reg_mod.T_SPEEDUP] = json.dumps(speedup, sort_keys=True)
    proposal = (state["steps"].get("evaluate") or {}).get("k_proposal")
    if proposal:
        tags[reg_mod.T_K_SCHEDULE] = json.dumps(proposal["schedule"])
    mv = reg.register(run["run_id"], tags, model_id=run.get("model_id"),
                      description=tracking.gate_table(gate_mod.Verdict.from_json(g)))
    if opts.fault:
        opts.fault("register.version_created")
    return {"version": mv.version, "model": reg.name, "uri": reg.head_uri(mv.version)}


def speedup_vs_nospec(cx: Cycle, state: dict[str, Any]) -> dict[str, float]:
    """The candidate's measured tok/s over no speculation per concurrency (empty: not measured)."""
    from evaluation.result import BenchResult

    b = state["steps"].get("bench") or {}
    path = b.get("nospec_json_path", b.get("json_path"))
    if b.get("skipped") or not path:
        return {}
    res = BenchResult.load(cx.local(state, path))
    return {str(c): x for c, x in res.speedup().items()}


def step_promote(cx: Cycle, state: dict[str, Any], opts: CycleOptions) -> dict[str, Any]:
    g, r = _out(state, "gate"), _out(state, "register")
    if not g["passed"]:
        return {"promoted": False, "reason": g["reason"]}
    out: dict[str, Any] = {"promoted": True,
                           **cx.registry.promote(r["version"], reason=f"cycle {state['cycle_id']}: gate passed")}
    if opts.router_url:
        from rollout.controller import Controller

        # One reconcile pass now instead of waiting for the controller's next poll.
        out["swap"] = Controller(cx.cfg, router_url=opts.router_url).reconcile()
    return out


IN_PROCESS.update(train=train_here, evaluate=evaluate_here)

STEP_FUNCS: dict[str, Callable[[Any, dict[str, Any], CycleOptions], dict[str, Any]]] = {
    "ingest": step_ingest, "snapshot": step_snapshot, "base": step_base, "train": step_train,
    "evaluate": step_evaluate, "bench": step_bench, "gate": step_gate, "log_run": step_log_run,
    "register": step_register, "promote": step_promote,
}


# --- drivers ---------------------------------------------------------------------------

def run_step(cfg: Config, cycle_id: str, step: str, opts: CycleOptions | None = None,
             cx: Cycle | None = None) -> dict[str, Any]:
    """Run one step of ``cycle_id`` unless already recorded; returns its (small) output.

    ``cx``: the cycle's collaborators when the caller runs several steps (built here otherwise).
    """
    if step not in STEP_FUNCS:
        raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}")
    opts = opts or CycleOptions()
    cx = cx or Cycle(cfg)
    state = cx.load_state(cycle_id)
    if step in state["steps"]:
        log.info(json.dumps({"event": "cycle.step.skip", "cycle_id": cycle_id, "step": step}))
        return state["steps"][step]
    missing = [s for s in STEPS[:STEPS.index(step)] if s not in state["steps"]]
    if missing:
        raise CycleError(f"cycle {cycle_id}: step {step!r} needs {missing} first")
    state.setdefault("options", {}).update({k: v for k, v in opts.to_json().items() if v is not None})
    t0 = _dt.datetime.now(_dt.timezone.utc)
    if opts.progress:
        opts.progress(f"cycle {cycle_id}: {step} ({STEPS.index(step) + 1}/{len(STEPS)})")
    run = tracking.CycleRun(cfg, state, cx.registry, cx.store)
    run.open()
    cx.save_state(state)  # the run id, so every later step (any worker) logs into the same run
    try:
        out = STEP_FUNCS[step](cx, state, opts)
    except BaseException as exc:
        run.failed(step, exc)
        raise
    out = json.loads(json.dumps(out, default=str))
    for rel in sorted(set(relative_paths(out))):  # what later steps (on any worker) will read
        cx.store.push(cycle_id, rel)
    state["steps"][step] = out
    state.setdefault("timings", {})[step] = round((_dt.datetime.now(_dt.timezone.utc) - t0).total_seconds(), 3)
    cx.save_state(state)
    run.step_done(step)
    if step == STEPS[-1]:
        run.finished()
    cx.save_state(state)
    log.info(json.dumps({"event": "cycle.step.done", "cycle_id": cycle_id, "step": step}))
    if opts.progress:
        opts.progress(f"cycle {cycle_id}: {step} done in {state['timings'][step]:.0f}s")
    if opts.fault:
        opts.fault(step)
    return out


def summary(cfg: Config, cycle_id: str, cx: Cycle | None = None) -> dict[str, Any]:
    """The cycle's JSON: every artifact and decision recorded so far (paths on this worker)."""
    cx = cx or Cycle(cfg)
    state = cx.load_state(cycle_id)
    s = state["steps"]
    d = cx.dir(cycle_id)

    def here(path: str | None) -> str | None:
        return None if path is None else str(d / path) if not Path(path).is_absolute() else path

    g, r, p = s.get("gate") or {}, s.get("register") or {}, s.get("promote") or {}
    return {
        "cycle_id": cycle_id,
        "complete": all(k in s for k in STEPS),
        "state_file": str(d / "state.json"),
        "registered_model": cfg.mlflow.registered_model,
        "version": r.get("version"),
        "verdict": g.get("verdict"),
        "reason": g.get("reason"),
        "promoted": p.get("promoted"),
        "run_id": (s.get("log_run") or {}).get("run_id"),
        "artifacts": {
            "train_snapshot": (s.get("snapshot") or {}).get("train"),
            "heldout_snapshot": (s.get("snapshot") or {}).get("heldout"),
            "head": here((s.get("train") or {}).get("head_path")),
            "head_sha256": (s.get("train") or {}).get("head_sha256"),
            "offline_eval": here((s.get("evaluate") or {}).get("json_path")),
            "bench_json": here((s.get("bench") or {}).get("json_path")),
            "bench_plot": here((s.get("bench") or {}).get("plot_path")),
            # the attempt that measured no speculation (None: none did)
            "nospec_bench_json": here((s.get("bench") or {}).get("nospec_json_path",
                                                                (s.get("bench") or {}).get("json_path"))),
            "model_uri": r.get("uri"),
        },
        # [serving] num_speculative_tokens_per_batch_size the candidate supports (None: no [bench] step_times)
        "proposed_k_per_batch_size": ((s.get("evaluate") or {}).get("k_proposal") or {}).get("schedule"),
        # Tasks that failed for good in Airflow (loop.airflow_tasks.on_task_failure), oldest first.
        "failures": state.get("failures", []),
        "steps": s,
        "timings": state.get("timings", {}),
    }


def run_cycle(cfg: Config, cycle_id: str | None = None, opts: CycleOptions | None = None) -> dict[str, Any]:
    """Run (or resume) a whole cycle; returns :func:`summary`. Default id: resume the newest unfinished cycle."""
    cycle_id = cycle_id or latest_unfinished(cfg) or new_cycle_id()
    cx = Cycle(cfg)
    for step in STEPS:
        run_step(cfg, cycle_id, step, opts, cx)
    return summary(cfg, cycle_id, cx)
