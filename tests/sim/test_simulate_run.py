"""`ecoserve simulate run --out DIR`: the summary JSON holds the per-instance list, printed as a table."""
import json

import pytest

from ecoserve.cli import main as cli_main

KEYS = {"id", "busy_fraction", "num_windows", "mean_window_s", "routed_fraction"}


@pytest.mark.parametrize("strategy,mode,has_windows", [("ecoserve", "paper", True), ("ecoserve", "reference", True),
                                                       ("vllm", "paper", False)])
def test_run_writes_instances_list(tmp_path, capsys, strategy, mode, has_windows):
    rc = cli_main(["simulate", "run", "--strategy", strategy, "--router-mode", mode, "--model", "llama-3-8b",
                   "--tp", "1", "--num-instances", "4", "--dataset", "alpaca", "--rate", "8",
                   "--num-requests", "60", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "run.json").read_text())["instances"]
    assert [r["id"] for r in rows] == [0, 1, 2, 3] and all(set(r) == KEYS for r in rows)
    assert all(0 <= r["busy_fraction"] <= 1 for r in rows) and max(r["busy_fraction"] for r in rows) > 0
    assert sum(r["routed_fraction"] for r in rows) == pytest.approx(1)
    if has_windows:
        assert sum(r["num_windows"] for r in rows) >= 1
    else:  # no windows: null, not zero
        assert all(r["num_windows"] is None and r["mean_window_s"] is None for r in rows)
    assert "mean window s" in capsys.readouterr().out  # the table
