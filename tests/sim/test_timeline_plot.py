"""The cluster timeline: its recorder, its JSON round trip, the PNG with one row per instance, and
`ecoserve simulate run --plot PATH`."""
import json

import pytest

from ecoserve.cli import main as cli_main
from ecoserve.cluster.timeline import ClusterTimeline, PhaseSegment, TimelineRecorder, WindowInterval
from ecoserve.sim.cluster import ClusterSpec, build
from ecoserve.sim.timeline_plot import plot_timeline
from ecoserve.sim.workload import synthetic


def test_recorder_merges_repeats_and_cuts_open_segments_at_now():
    rec = TimelineRecorder([0, 1])
    rec.phase(0.0, 0, "idle")
    rec.phase(1.0, 0, "prefill")
    rec.phase(1.5, 0, "prefill")  # a repeat: no new segment
    rec.phase(2.0, 0, "decode")
    rec.window_opened(1.0, 0)
    rec.window_closed(2.0, 0)
    rec.window_opened(3.0, 1)  # still open at the snapshot
    rec.routed(1.0, 0)
    tl = rec.snapshot(4.0)
    assert tl.instances == [0, 1]
    assert tl.phases == [PhaseSegment(0, 0.0, 1.0, "idle"), PhaseSegment(0, 1.0, 2.0, "prefill"),
                         PhaseSegment(0, 2.0, 4.0, "decode")]
    assert tl.windows == [WindowInterval(0, 1.0, 2.0), WindowInterval(1, 3.0, 4.0)]
    assert ClusterTimeline.from_json(json.dumps(tl.to_json())) == tl


def test_recorder_memory_is_bounded():
    rec = TimelineRecorder(max_events=10)
    for k in range(100):
        rec.routed(float(k), k % 3)
        rec.phase(float(k), 0, "prefill" if k % 2 else "decode")
    tl = rec.snapshot(100.0)
    assert len(tl.routed) == 10 and tl.routed[-1].time == 99.0
    assert len(tl.phases) <= 11


@pytest.fixture(scope="module")
def simulated():
    """A small EcoServe cluster: 3 instances, windows rolling, requests routed."""
    spec = ClusterSpec(model="llama-3-8b", tp=1, num_instances=3)
    sim = build("ecoserve", spec, 1.0, 0.1)
    res = sim.run(synthetic("alpaca", 8.0, 40, seed=0))
    return sim.timeline.snapshot(res.sim_time)


def test_simulator_records_phases_windows_and_routing(simulated):
    tl = simulated
    assert tl.instances == [0, 1, 2]
    assert {s.phase for s in tl.phases} >= {"prefill", "decode"}
    assert len(tl.routed) >= 40 and {r.instance_id for r in tl.routed} <= {0, 1, 2}
    assert tl.windows and all(w.end >= w.start for w in tl.windows)
    for iid in tl.instances:  # an instance's segments follow each other without overlap
        segs = sorted((s for s in tl.phases if s.instance_id == iid), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(segs, segs[1:]))


def test_plot_has_one_row_per_instance(simulated, tmp_path):
    path = tmp_path / "timeline.png"
    fig = plot_timeline(simulated, path)
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == len(simulated.instances) == 3
    assert [t.get_text() for t in ax.get_yticklabels()] == ["inst 0", "inst 1", "inst 2"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_simulate_run_plot_writes_png(tmp_path, capsys):
    path = tmp_path / "sub" / "cluster.png"
    rc = cli_main(["simulate", "run", "--strategy", "ecoserve", "--model", "llama-3-8b", "--tp", "1",
                   "--num-instances", "2", "--dataset", "alpaca", "--rate", "8", "--num-requests", "20",
                   "--out", str(tmp_path), "--plot", str(path)])
    assert rc == 0
    assert path.exists() and path.stat().st_size > 1000
    assert f"wrote {path}" in capsys.readouterr().out
