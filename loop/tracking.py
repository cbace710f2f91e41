"""A cycle's MLflow run, as its reviewers read it: opened at the first step, each step's figures
logged the moment the step finishes, the head as a logged model, closed when the cycle ends.

* one run per cycle, found again by its ``adapt.cycle_id`` tag (a resumed or retried cycle,
  on any worker, logs into the same run; its status goes back to RUNNING meanwhile);
* step by step: ingest counts, snapshot sizes and held-out repeats, the parent, the training
  loss per optimizer step, offline acceptance per draft position, the bench (acceptance per
  position, tok/s and the latency percentiles per arm and concurrency, candidate − reference
  (the live head and its A/A control pooled) and the A/A control, speed-up over no speculation, one point per bench attempt), the gate's
  verdict, and each step's duration;
* the trained head is an MLflow LoggedModel (its files plus the manifest's fields as params
  and tags), which the registered version points at (``models:/<model id>``), and the
  version's description is the gate's table, so the stock registry UI says why it passed or not.

Logging never decides anything: the cycle's state file stays the record of what happened.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

from loop.gate import Verdict
from loop.store import CycleStore
from rollout import registry as reg_mod
from settings.config import Config

MODEL_TYPE = "p-eagle-head"


def _flat(prefix: str, obj: Any, out: dict[str, float]) -> None:
    """Numeric leaves of nested dicts/lists as MLflow metric names (``a.b_pos0``)."""
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        if not math.isnan(float(obj)) and not math.isinf(float(obj)):
            out[prefix] = float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, list) and len(obj) <= 64:
        for i, v in enumerate(obj):
            _flat(f"{prefix}_pos{i}" if isinstance(v, (int, float)) else f"{prefix}_{i}", v, out)


OFFLINE_FIGURES = ("mean_acceptance_length", "acceptance_rate_per_pos", "draft_acceptance_rate", "num_prompts")


def offline_metrics(out: dict[str, Any]) -> dict[str, float]:
    """The evaluate step's figures per head (not its per-prompt counts), and the pre-screen's difference."""
    m: dict[str, float] = {}
    for role in ("candidate", "live"):
        _flat(f"offline.{role}", {k: v for k, v in (out.get(role) or {}).items() if k in OFFLINE_FIGURES}, m)
    check = out.get("check") or {}
    _flat("offline.difference", {"estimate": check.get("estimate"), "ci": check.get("ci")}, m)
    return m


def bench_metrics(path: Path) -> dict[str, float]:
    """A bench result's metrics (``evaluation.result.BenchResult.metrics``)."""
    from evaluation.result import BenchResult

    return BenchResult.load(path).metrics()


def run_metrics(state: dict[str, Any], resolve=Path) -> dict[str, float]:
    """Everything a reviewer compares, from the recorded steps (the final bench attempt's figures).

    ``resolve`` turns a recorded path into a local one (the cycle store's ``pull``).
    """
    s = state["steps"]
    m: dict[str, float] = {}
    tr = s.get("train") or {}
    _flat("train", {k: tr.get(k) for k in ("steps", "tokens", "tokens_per_s", "final_depth_loss",
                                           "final_depth_acc")}, m)
    m.update(offline_metrics(s.get("evaluate") or {}))
    b = s.get("bench") or {}
    if b.get("json_path"):
        m.update(bench_metrics(resolve(b["json_path"])))
        ref = b.get("nospec_json_path")
        if ref and ref != b["json_path"]:  # no speculation was measured in an earlier attempt only
            m.update({k: v for k, v in bench_metrics(resolve(ref)).items() if k.startswith("speedup_vs_nospec.")})
        m["bench.attempts"] = float(len(b.get("attempts") or [1]))
    overlap = (s.get("snapshot") or {}).get("heldout_overlap") or {}
    if overlap:
        m["heldout.repeats_training"] = float(overlap.get("repeats_training", 0))
    if "gate" in s:
        m["gate.passed"] = 1.0 if s["gate"]["passed"] else 0.0
    return m


def run_params(cfg: Config, state: dict[str, Any]) -> dict[str, str]:
    """The cycle's inputs and settings: lineage (parent, live head, snapshots) and the config sections."""
    s = state["steps"]
    snap, base, tr = s.get("snapshot") or {}, s.get("base") or {}, s.get("train") or {}
    p: dict[str, str] = {"cycle_id": state["cycle_id"], "target": cfg.target.model}
    if base:
        p.update({"parent_version": str(base.get("parent_version") or "none"),
                  "parent_sha256": str(base.get("parent_sha256") or "none"),
                  "live_version": str(base.get("live_version") or "none"),
                  "live_sha256": str(base.get("live_sha256") or "none")})
    if snap.get("train"):
        p.update({"train_snapshot_id": snap["train"]["id"], "heldout_snapshot_id": snap["heldout"]["id"],
                  "train_rows": str(snap["train"]["rows"]), "heldout_rows": str(snap["heldout"]["rows"])})
    if tr.get("head_sha256"):
        p["head_sha256"] = tr["head_sha256"]
    for section in ("head", "training", "bench", "gate"):
        for k, v in getattr(cfg, section).model_dump(mode="json").items():
            p[f"{section}.{k}"] = json.dumps(v) if isinstance(v, list) else str(v)
    return p


def gate_table(v: "Verdict") -> str:
    """The gate's checks as a Markdown table (the registered version's description in the MLflow UI)."""
    head = f"**Gate: {v.status}**" + (f" after {v.attempts} benchmark(s)" if v.attempts else "")
    if v.level is not None:
        head += f" (each bound a one-sided {v.level:.3g} test)"
    lines = [head, "", "| check | status | candidate − reference [bounds] | A/A control | margin | prompt groups |",
             "|---|---|---|---|---|---|"]

    def fmt(ci) -> str:
        return "-" if not ci or ci[0] is None else f"[{ci[0]:+.4g}, {ci[1]:+.4g}]"

    for c in v.checks:
        span = "-" if c.estimate is None else f"{c.estimate:+.4g} {fmt(c.ci)}"
        margin = "-" if c.margin is None else f"{c.margin:.4g} {c.unit}"
        lines.append(f"| {c.name} | {c.status} | {span} | {fmt(c.aa_ci)} | {margin} | {c.clusters or '-'} |")
    if v.voided:
        lines.append(f"\nVoided by the A/A control: attempt(s) {', '.join(map(str, v.voided))}.")
    lines += ["", v.reason[:3000]]
    return "\n".join(lines)


def _dataset(path: str, name: str, source_uri: str, digest: str):
    """A dataset input for a Parquet snapshot: its content hashes, digest = the snapshot id."""
    import pandas as pd
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.pandas_dataset import PandasDataset

    df = pd.read_parquet(path, columns=["content_hash", "format", "endpoint"])
    # MLflow has no dataset source for run artifacts; an HTTP link to the artifact is one a reviewer can open.
    src = HTTPDatasetSource(source_uri) if source_uri.startswith("http") else resolve_dataset_source(source_uri)
    return PandasDataset(df=df, source=src, name=name, digest=digest[:36])


class CycleRun:
    """The MLflow run of one cycle; every method is safe to call again after a crash."""

    def __init__(self, cfg: Config, state: dict[str, Any], registry: reg_mod.Registry | None = None,
                 store: CycleStore | None = None) -> None:
        self.cfg, self.state = cfg, state
        self.reg = registry or reg_mod.Registry(cfg)
        self.client = self.reg.client
        self.store = store or CycleStore(cfg)

    def _p(self, path: str) -> Path:
        """A recorded path, local on this worker."""
        return self.store.pull(self.state["cycle_id"], path)

    @property
    def run_id(self) -> str:
        return self.state["tracking"]["run_id"]

    def open(self) -> str:
        """Find or create the cycle's run and mark it RUNNING (a resumed cycle reopens its run)."""
        tr = self.state.setdefault("tracking", {})
        if not tr.get("run_id"):
            cid = self.state["cycle_id"]
            tr["run_id"] = self.reg.ensure_run(cid, run_name=f"cycle-{cid}")
        run = self.client.get_run(tr["run_id"])
        if run.info.status != "RUNNING":
            self.client.update_run(tr["run_id"], status="RUNNING")
        return tr["run_id"]

    def _metrics(self, values: dict[str, float], step: int = 0, model_id: str | None = None) -> None:
        from mlflow.entities import Metric

        now = int(_dt.datetime.now().timestamp() * 1000)
        ms = [Metric(k, v, now, step, model_id=model_id) for k, v in values.items()]
        for i in range(0, len(ms), 900):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=ms[i:i + 900])

    def _params(self) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        new = [Param(k, v[:6000]) for k, v in run_params(self.cfg, self.state).items() if k not in have]
        if new:
            self.client.log_batch(self.run_id, params=new)

    def step_done(self, step: str) -> None:
        """Log what ``step`` produced, and its duration."""
        s = self.state["steps"]
        out = s[step]
        self._params()
        self._metrics({f"timing.{step}_s": float(self.state.get("timings", {}).get(step, 0.0))})
        if step == "ingest":
            self._metrics({f"ingest.{k}": float(v) for k, v in out.items() if isinstance(v, (int, float))
                           and not isinstance(v, bool)})
        elif step == "snapshot":
            self._snapshot(out)
        elif step == "train" and out.get("head_path"):
            self._train(out)
        elif step == "evaluate":
            self._metrics(offline_metrics(out), model_id=self.state["tracking"].get("model_id"))
        elif step == "bench" and out.get("attempts"):
            for a in out.get("attempts") or []:
                self._metrics(bench_metrics(self._p(a["json_path"])), step=a["attempt"],
                              model_id=self.state["tracking"].get("model_id"))
            self._metrics({"bench.attempts": float(len(out.get("attempts") or [1]))})
        elif step == "gate" and "verdict" in out:
            self._metrics({"gate.passed": 1.0 if out["passed"] else 0.0})
            self.client.set_tag(self.run_id, reg_mod.T_GATE, out["verdict"])
            self.client.set_tag(self.run_id, reg_mod.T_REASON, out["reason"][:4900])
            self.client.log_dict(self.run_id, out, "cycle/gate.json")
            self.client.log_text(self.run_id, gate_table(Verdict.from_json(out)), "cycle/gate.md")

    def _snapshot(self, out: dict[str, Any]) -> None:
        m = {f"snapshot.{split}_rows": float(out[split]["rows"]) for split in ("train", "heldout") if split in out}
        if out.get("heldout", {}).get("measured_rows") is not None:
            m["snapshot.heldout_measured_rows"] = float(out["heldout"]["measured_rows"])
        if out.get("heldout_overlap"):
            m["heldout.repeats_training"] = float(out["heldout_overlap"].get("repeats_training", 0))
        self._metrics(m)

    def _train(self, out: dict[str, Any]) -> None:
        """The loss per optimizer step, the final figures, and the head as a logged model."""
        from mlflow.entities import Metric

        from headspec.files import read_manifest

        tj = self._p(out["train_json"])
        curve = (json.loads(tj.read_text()).get("loss_curve") or []) if tj.is_file() else []

        now = int(_dt.datetime.now().timestamp() * 1000)
        pts = [Metric("train.loss", float(v), now, i) for i, v in enumerate(curve) if math.isfinite(float(v))]
        for i in range(0, len(pts), 900):
            self.client.log_batch(self.run_id, metrics=pts[i:i + 900])
        m: dict[str, float] = {}
        _flat("train", {k: out.get(k) for k in ("steps", "tokens", "tokens_per_s", "final_depth_loss",
                                                "final_depth_acc")}, m)
        self._metrics(m)
        tr = self.state["tracking"]
        if tr.get("model_id"):
            return
        head = self._p(out["head_path"])
        manifest = read_manifest(head)
        target = manifest.get("target") or {}
        params = {"sha256": out["head_sha256"], "num_speculative_tokens": str(out["num_speculative_tokens"]),
                  "format": str(manifest.get("format")), "parent": str(manifest.get("parent")),
                  "target": str(target.get("name")), "target_weights_sha256": str(target.get("weights_sha256")),
                  "data_snapshot": json.dumps(manifest.get("data_snapshot"))[:6000],
                  "drafter_config": json.dumps(manifest.get("drafter_config"))[:6000]}
        model = self.client.create_logged_model(
            self.reg.experiment_id(), name=f"{self.cfg.mlflow.registered_model}-head", source_run_id=self.run_id,
            params=params, model_type=MODEL_TYPE,
            tags={reg_mod.T_SHA: out["head_sha256"], reg_mod.T_CYCLE: self.state["cycle_id"]})
        self.client.log_model_artifacts(model.model_id, str(head))
        self.client.finalize_logged_model(model.model_id, "READY")
        tr["model_id"] = model.model_id

    def artifacts(self) -> dict[str, Any]:
        """The reviewer's files: datasets (also as dataset inputs), the bench directory, the cycle's JSONs."""
        import mlflow

        s = self.state["steps"]
        snap, b = s["snapshot"], s["bench"]
        for split in ("train", "heldout"):
            self.client.log_artifact(self.run_id, str(self._p(snap[split]["path"])), "datasets")
        if not b.get("skipped"):
            self.client.log_artifacts(self.run_id, str(self._p(b["json_path"]).parent), "bench")
        self.client.log_artifact(self.run_id, str(self._p(s["train"]["train_json"])), "cycle")
        if (s.get("evaluate") or {}).get("json_path"):
            self.client.log_artifact(self.run_id, str(self._p(s["evaluate"]["json_path"])), "cycle")
        run = self.client.get_run(self.run_id)
        if not run.inputs or not run.inputs.dataset_inputs:
            mlflow.set_tracking_uri(self.reg.tracking_uri)
            with mlflow.start_run(run_id=self.run_id):
                for split, ctx in (("train", "training"), ("heldout", "evaluation")):
                    sp = snap[split]
                    path = self._p(sp["path"])
                    if self.reg.tracking_uri.startswith("http"):
                        src = (f"{self.reg.tracking_uri.rstrip('/')}/get-artifact?path=datasets/{path.name}"
                               f"&run_uuid={self.run_id}")
                    else:
                        src = str(path)
                    ds = _dataset(str(path), f"{self.cfg.mlflow.registered_model}-{split}-{sp['id'][:12]}", src,
                                  sp["id"])
                    mlflow.log_input(ds, context=ctx)
        return {"run_id": self.run_id, "artifact_uri": run.info.artifact_uri, "model_id": self.state["tracking"].get(
            "model_id"), "metrics": len(run_metrics(self.state, self._p))}

    def failed(self, step: str, exc: BaseException) -> None:
        self.client.set_tag(self.run_id, "adapt.failed_step", step)
        self.client.set_tag(self.run_id, "adapt.error", f"{type(exc).__name__}: {exc}"[:4900])
        self.client.set_terminated(self.run_id, "FAILED")

    def finished(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
