"""The bench plot: acceptance per draft position and throughput of every arm, candidate − reference beside the A/A control."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evaluation.result import BenchResult

COLORS = {"candidate": "#1f77b4", "live": "#9e9e9e", "control": "#cfcfcf", "nospec": "#ff7f0e"}


def _aa(iv, fmt: str) -> str:
    """The A/A control's interval, as the reader compares it with the difference's."""
    if iv is None or iv.lo is None:
        return ""
    return f"\nA/A (control − live) [{iv.lo:{fmt}}, {iv.hi:{fmt}}]"


def plot_bench(result: "BenchResult", path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ph, df, heads, aa = result.arms, result.differences, result.heads, result.aa_control
    arms = [a for a in ("live", "control", "candidate", "nospec") if a in ph]
    spec_arms = [a for a in arms if a != "nospec"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})

    # Left: probability that draft position i is accepted (higher = better drafter).
    width = 0.8 / len(spec_arms)
    for j, role in enumerate(spec_arms):
        spec = ph[role].spec
        acc = [x if x == x else 0.0 for x in (spec.acceptance_per_pos if spec else [])]
        xs = [i + (j - (len(spec_arms) - 1) / 2) * width for i in range(len(acc))]
        mal = ph[role].mean_acceptance_length
        head = heads.get("live" if role == "control" else role)
        sha = head.sha256[:8] if head else ""
        label = f"{role} {sha}  (mean acc. len {mal:.2f})" if mal else role
        bars = ax1.bar(xs, acc, width, color=COLORS[role], label=label)
        for b, v in zip(bars, acc):
            ax1.annotate(f"{v:.3f}" if v < 0.1 else f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    per_pos = {r: [x for x in (ph[r].spec.acceptance_per_pos if ph[r].spec else []) if x == x] for r in spec_arms}
    n_pos = max(len(v) for v in per_pos.values())
    ax1.set_xticks(range(n_pos), [f"pos {i + 1}" for i in range(n_pos)])
    # Scale to the data (low acceptance must still be readable), never beyond 1.
    top = max([x for v in per_pos.values() for x in v] + [0.0])
    ax1.set_ylim(0, min(1.08, max(0.05, top * 1.3)))
    ax1.set_ylabel("acceptance rate (accepted / drafts)")
    d = df.mean_acceptance_length
    if d.estimate is not None and d.lo is not None:
        ax1.set_title(f"Acceptance per draft position\nΔ mean acceptance length {d.estimate:+.3f} "
                      f"[{d.lo:+.3f}, {d.hi:+.3f}]\n({d.confidence:.0%} CI, {d.clusters} prompt groups)"
                      + _aa(aa.mean_acceptance_length if aa else None, "+.3f"), fontsize=9)
    else:
        ax1.set_title("Acceptance per draft position", fontsize=10)
    ax1.legend(fontsize=8, loc="upper right")
    ax1.grid(axis="y", alpha=0.3)

    # Right: output tokens/s per concurrency, annotated with the bootstrap CI of the difference.
    concs = list(result.concurrencies)
    width = 0.8 / len(arms)
    for j, role in enumerate(arms):
        vals = [result.tok_per_s(role, c) or 0.0 for c in concs]
        xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(concs))]
        bars = ax2.bar(xs, vals, width, color=COLORS[role], label=role)
        for b, v in zip(bars, vals):
            ax2.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    labels = []
    for c in concs:
        dd, tp = df.by_concurrency[c]["output_tok_per_s"], df.by_concurrency[c]["tpot_ms"]
        if dd.estimate is None or dd.lo is None:
            labels.append(f"concurrency {c}")
        else:
            labels.append(f"concurrency {c}\nΔ {dd.estimate:+.1f} tok/s [{dd.lo:+.1f}, {dd.hi:+.1f}]"
                          + _aa(aa.tok_per_s(c) if aa else None, "+.1f")
                          + (f"\nΔ TPOT {tp.estimate:+.2f} ms" if tp.estimate is not None else ""))
    ax2.set_xticks(range(len(concs)), labels, fontsize=8)
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("Throughput: Δ = candidate − (live + control) / 2,\ncluster t-interval", fontsize=9)
    ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)

    fig.suptitle(f"Replay bench: {result.requests} held-out requests × {result.rounds} counterbalanced rounds",
                 fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_learning_curve(runs: list[dict], path: str | Path, anchors: list[dict] | None = None) -> Path:
    """Acceptance length and per-position acceptance against training conversations (log scale), one marker
    per run's device (``runs``: benchmarks/learning_curve.py results), the largest point's goal as a line;
    ``anchors`` (``{"label", "conversations", "acceptance_length", "per_position"}``): published figures, as stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    markers = {"cuda": "o", "cpu": "s"}
    goal = None
    for run in runs:
        pts = sorted(run.get("points", []), key=lambda p: p["conversations"])
        if not pts:
            continue
        kind = "cuda" if str(run.get("device", "")).startswith("cuda") else "cpu"
        label = f"{run.get('device_name') or kind}"
        xs = [p["conversations"] for p in pts]
        ax1.plot(xs, [p["acceptance"]["mean_acceptance_length"] for p in pts], marker=markers[kind], label=label)
        for d in range(len(pts[0]["acceptance"]["acceptance_rate_per_pos"])):
            ax2.plot(xs, [p["acceptance"]["acceptance_rate_per_pos"][d] for p in pts], marker=markers[kind],
                     color=f"C{d}", linestyle="-" if kind == "cuda" else "--", label=f"position {d + 1} ({label})")
        goal = (run.get("goal") or {}).get("acceptance_length", goal)
    for a in anchors or []:
        ax1.plot([a["conversations"]], [a["acceptance_length"]], marker="*", markersize=12, color="black",
                 linestyle="none", label=a["label"])
        for d, r in enumerate(a["per_position"]):
            ax2.plot([a["conversations"]], [r], marker="*", markersize=12, color=f"C{d}", linestyle="none",
                     label=f"position {d + 1} ({a['label']})" if d == 0 else None)
    if goal:
        ax1.axhline(goal, color="#999999", linestyle=":", label=f"target {goal}")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("training conversations (on-policy ShareGPT first turns)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("acceptance length at K=3 (held-out)")
    ax2.set_ylabel("acceptance rate per draft position")
    ax1.set_title("acceptance length")
    ax2.set_title("per position (accepted with every earlier one)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
