"""Goodput experiments on curves: a tiny overall run writes both definitions, curves and a PNG per cell;
scripts/sim_tables.py prints the per-cell tables and flags ratios far from the paper's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ecoserve.sim.experiments as experiments
from ecoserve.sim.cluster import ClusterSpec
from ecoserve.sim.metrics import CurveConfig

SCRIPT = Path(__file__).parents[2] / "scripts" / "sim_tables.py"


@pytest.fixture
def tiny(monkeypatch):
    """A 2-instance 8B cluster, a coarse grid and short arrivals, so that a cell takes seconds."""
    monkeypatch.setattr(experiments, "l20_spec", lambda model, n=2, **kw: ClusterSpec(
        model="llama-3-8b", gpu="L20", tp=1, num_instances=n, network="10gbe", **kw))
    monkeypatch.setattr(experiments, "CURVE", CurveConfig(ratio=2.0, max_points=4))
    monkeypatch.setattr(experiments, "ARRIVAL_S", 2.0)
    monkeypatch.setattr(experiments, "START_PER_INSTANCE", {"alpaca": 16.0})


def test_overall_writes_both_definitions_curves_and_pngs(tmp_path, tiny):
    data = experiments.overall(tmp_path, models=("llama-30b",), datasets=("alpaca",),
                               strategies=("vllm", "mooncake", "ecoserve"), num_requests=30)
    cell = data["results"]["llama-30b/alpaca"]
    for s, r in cell.items():
        for t in ("p90", "p99"):
            g = r["goodput"][t]
            assert 0 <= g["monotone"] <= g["max"]
        assert r["goodput"]["p99"]["monotone"] <= r["goodput"]["p90"]["monotone"]
        assert r["goodput"]["p99"]["max"] <= r["goodput"]["p90"]["max"]
    pts = cell["vllm"]["points"]
    assert 2 <= len(pts) <= 4 and {"rate", "attainment", "ttft_p90", "tpot_p90"} <= set(pts[0])
    assert [p["rate"] for p in pts] == sorted(p["rate"] for p in pts) and pts[-1]["attainment"] < 0.9
    assert cell["mooncake"]["pd"]["p90"]["max"] == [1, 1] and "1:1" in cell["mooncake"]["curves"]
    ratio = data["ecoserve_over"]["ecoserve"]["vllm"]["p90"]
    assert ratio["max"] == pytest.approx(cell["ecoserve"]["goodput"]["p90"]["max"] / cell["vllm"]["goodput"]["p90"]["max"])
    assert (tmp_path / "curves" / "llama-30b_alpaca.png").stat().st_size > 0
    saved = json.loads((tmp_path / "overall.json").read_text())
    assert saved["goodput"]["llama-30b/alpaca"]["vllm"] == cell["vllm"]["goodput"]


def _g(mono: float, mx: float, p99: float | None = None) -> dict:
    p99 = mono if p99 is None else p99
    return {"p90": {"monotone": mono, "max": mx}, "p99": {"monotone": p99, "max": p99}}


def test_sim_tables_flags_ratios_off_the_papers(tmp_path):
    # EcoServe (paper mode) is 2.0x vLLM on both cells by `max` (paper: 1.96x, within 25%) but only 1.0x
    # by `monotone` (a dip), so the monotone ratio is flagged and the max one is not.
    cells = {f"llama-30b/{d}": {"vllm": _g(10, 10), "sarathi": _g(10, 10), "ecoserve": _g(10, 20),
                                "ecoserve_ref": _g(19, 20)} for d in ("alpaca", "sharegpt")}
    results = {k: {s: {"goodput": g} for s, g in v.items()} for k, v in cells.items()}
    (tmp_path / "ov").mkdir()
    (tmp_path / "ov" / "overall.json").write_text(json.dumps({"curve": {}, "goodput": cells, "results": results}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "| llama-30b/alpaca | 10.0 / 10.0 | 10.0 / 10.0 | 10.0 / 20.0 | 19.0 / 20.0 |" in out
    vs_vllm = next(line for line in out.splitlines() if line.startswith("| vs vllm |"))
    assert vs_vllm.startswith("| vs vllm | 1.00x† | 2.00x | 1.90x | 2.00x | 1.96x |")
    flags = out[out.index("#### Flags"):]
    assert "| vs vllm | monotone | 1.96x | 1.00x (0.51) | within |" in flags  # reference mode is within 25%
    assert "| vs vllm | max |" not in flags
    assert "| vs sarathi | monotone | 1.99x | 1.00x (0.50) |" in flags


def test_sim_tables_prints_the_other_goodput_experiments(tmp_path):
    meta = {"curve": {}}
    (tmp_path / "slo.json").write_text(json.dumps({**meta, "goodput": {
        "vllm": {"5s/100ms": _g(20, 20, 10), "1s/50ms": _g(8, 9, 4)}}}))
    (tmp_path / "scaling.json").write_text(json.dumps({**meta, "goodput": {
        "qwen2-72b/ecoserve": {"1": _g(2, 2), "2": _g(4, 4), "4": _g(6, 11)}}}))
    (tmp_path / "ablation.json").write_text(json.dumps({**meta, "goodput": {"codellama-34b": {"paper": _g(3, 4)}}}))
    (tmp_path / "stepcost.json").write_text(json.dumps({**meta, "goodput": {
        "0ms+0ms/dec": {"sarathi": _g(10, 10), "ecoserve": _g(5, 12)}}}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "| vLLM | 10.0 / 10.0 | 4.0 / 4.0 | -60.0% / -60.0% | -60.0% |" in out  # P99 columns and drop
    assert "| qwen2-72b paper | 2.00 / 2.00 | 4.00 / 4.00 | 6.00 / 11.00 | 3.00x† | 5.50x | 5.47x |" in out
    assert "| qwen2-72b scaling | monotone | 5.47x | 3.00x (0.55) |" in out
    assert "| paper | 3.0 | 4.0 | 3.0 | 3.0 |" in out
    assert "| 0ms+0ms/dec | 10.0 / 10.0 | 5.0 / 12.0 | 0.50x |" in out
