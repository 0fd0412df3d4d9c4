"""`plot_timeline`: the cluster timeline as a PNG, the same picture for a simulated and a live run.

One row per instance: colored phase segments (prefill / decode / idle), the prefill windows as
an outline band under them, and a marker at each routed request's routing time.
"""
from __future__ import annotations

from pathlib import Path

from ecoserve.cluster.timeline import ClusterTimeline

PHASE_COLORS = {"prefill": "tab:orange", "decode": "tab:blue", "idle": "0.85"}


def plot_timeline(timeline: ClusterTimeline, path: str | Path, title: str | None = None):
    """Write the PNG at `path`; return the matplotlib figure (its axes' y ticks are the instances)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = {iid: k for k, iid in enumerate(timeline.instances)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.5 * max(len(rows), 1)))
    for phase, color in PHASE_COLORS.items():
        bars = [(s.start, s.end - s.start, rows[s.instance_id]) for s in timeline.phases
                if s.phase == phase and s.instance_id in rows]
        for k in set(b[2] for b in bars):
            ax.broken_barh([(x, w) for x, w, r in bars if r == k], (k - 0.3, 0.6), facecolors=color)
    for w in timeline.windows:
        if w.instance_id in rows:
            k = rows[w.instance_id]
            ax.broken_barh([(w.start, w.end - w.start)], (k - 0.45, 0.1), facecolors="tab:green")
    if timeline.routed:
        pts = [(r.time, rows[r.instance_id]) for r in timeline.routed if r.instance_id in rows]
        ax.scatter([t for t, _ in pts], [k + 0.38 for _, k in pts], marker="v", s=12, color="black", zorder=3)
    ax.set_yticks(range(len(rows)), [f"inst {i}" for i in rows])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or "cluster timeline")
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
    handles += [Patch(color="tab:green", label="prefill window"),
                ax.scatter([], [], marker="v", color="black", label="routed request")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig
