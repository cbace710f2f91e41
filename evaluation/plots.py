"""The bench plot: acceptance per draft position and throughput of every arm, candidate − live with the A/A spread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"candidate": "#1f77b4", "live": "#9e9e9e", "control": "#cfcfcf", "nospec": "#ff7f0e"}


def plot_bench(result: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from evaluation.stats import aa_noise

    ph, df, heads = result["per_head"], result["differences"], result["heads"]
    aa = result.get("aa_control") or {}
    arms = [a for a in ("live", "control", "candidate", "nospec") if a in ph]
    spec_arms = [a for a in arms if a != "nospec"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})

    # Left: probability that draft position i is accepted (higher = better drafter).
    width = 0.8 / len(spec_arms)
    for j, role in enumerate(spec_arms):
        spec = ph[role]["spec"] or {}
        acc = [x if x is not None else 0.0 for x in spec.get("acceptance_per_pos") or []]
        xs = [i + (j - (len(spec_arms) - 1) / 2) * width for i in range(len(acc))]
        mal = spec.get("mean_acceptance_length")
        sha = heads["live" if role == "control" else role]["sha256"][:8]
        label = f"{role} {sha}  (mean acc. len {mal:.2f})" if mal else role
        bars = ax1.bar(xs, acc, width, color=COLORS[role], label=label)
        for b, v in zip(bars, acc):
            ax1.annotate(f"{v:.3f}" if v < 0.1 else f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    n_pos = max(len((ph[r]["spec"] or {}).get("acceptance_per_pos") or []) for r in spec_arms)
    ax1.set_xticks(range(n_pos), [f"pos {i + 1}" for i in range(n_pos)])
    # Scale to the data (low acceptance must still be readable), never beyond 1.
    top = max([x or 0.0 for r in spec_arms for x in ((ph[r]["spec"] or {}).get("acceptance_per_pos") or [])] + [0.0])
    ax1.set_ylim(0, min(1.08, max(0.05, top * 1.3)))
    ax1.set_ylabel("acceptance rate (accepted / drafts)")
    d = df["mean_acceptance_length"]
    if d["estimate"] is not None and d["ci"][0] is not None:
        noise = aa_noise(aa.get("mean_acceptance_length"))
        ax1.set_title(f"Acceptance per draft position\nΔ mean acceptance length {d['estimate']:+.3f} "
                      f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] ({int(d['confidence'] * 100)}% CI)"
                      + (f", A/A ±{noise:.3f}" if noise is not None else ""), fontsize=10)
    else:
        ax1.set_title("Acceptance per draft position", fontsize=10)
    ax1.legend(fontsize=8, loc="upper right")
    ax1.grid(axis="y", alpha=0.3)

    # Right: output tokens/s per concurrency, annotated with the bootstrap CI of the difference.
    concs = [str(c) for c in result["concurrencies"]]
    width = 0.8 / len(arms)
    for j, role in enumerate(arms):
        vals = [ph[role]["by_concurrency"][c]["output_tok_per_s"] or 0.0 for c in concs]
        xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(concs))]
        bars = ax2.bar(xs, vals, width, color=COLORS[role], label=role)
        for b, v in zip(bars, vals):
            ax2.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    labels = []
    for c in concs:
        dd = df[f"c{c}"]["output_tok_per_s"]
        tp = df[f"c{c}"]["tpot_ms"]
        if dd["estimate"] is None or dd["ci"][0] is None:
            labels.append(f"concurrency {c}")
        else:
            noise = aa_noise((aa.get(f"c{c}") or {}).get("output_tok_per_s"))
            labels.append(f"concurrency {c}\nΔ {dd['estimate']:+.1f} tok/s [{dd['ci'][0]:+.1f}, {dd['ci'][1]:+.1f}]"
                          + (f" A/A ±{noise:.1f}" if noise is not None else "")
                          + (f"\nΔ TPOT {tp['estimate']:+.2f} ms" if tp["estimate"] is not None else ""))
    ax2.set_xticks(range(len(concs)), labels, fontsize=8)
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("Throughput (candidate − live, paired bootstrap CI, A/A spread)", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)

    n_rounds = len(result["rounds"])  # the per-round figures
    fig.suptitle(f"Replay bench: {result['requests']} held-out requests × {n_rounds} counterbalanced rounds",
                 fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
