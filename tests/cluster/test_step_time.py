"""The one tokens -> time table: the simulator's table model, mock instances and the live controller read it."""
import pytest

from ecoserve.cluster import ControllerOptions, RouterConfig, StepTimeTable
from ecoserve.sim.perf import StepWork, TablePerf

ROWS = [(1, 10.0), (16, 12.0), (64, 20.0), (256, 60.0), (512, 100.0)]


def test_linear_between_rows_flat_below_and_the_upper_half_beyond():
    t = StepTimeTable(reversed(ROWS))  # any order
    assert t.rows == ROWS
    assert t.ms(0) == t.ms(1) == 10.0
    assert t.ms(40) == pytest.approx(16.0) and t.seconds(40) == pytest.approx(0.016)
    slope = (100.0 - 20.0) / (512 - 64)  # from the middle row (index 5 // 2) to the last
    assert t.ms(1024) == pytest.approx(100.0 + slope * 512)


def test_short_and_noisy_tables_extrapolate_sensibly():
    assert StepTimeTable([(16, 5.0), (64, 9.0)]).ms(112) == pytest.approx(13.0)  # along both rows
    assert StepTimeTable([(16, 5.0)]).ms(32) == pytest.approx(10.0)  # in proportion to the only row
    assert StepTimeTable([(16, 5.0), (64, 4.0)]).ms(512) == 4.0  # a falling tail: never faster past the end
    with pytest.raises(ValueError, match="at least one"):
        StepTimeTable([])


def test_the_simulator_reads_the_same_table(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("Total Length,Execute Time\n" + "".join(f"{n},{ms}\n" for n, ms in ROWS))
    table, perf = StepTimeTable.from_csv(path), TablePerf.from_csv(path)
    for n in (1, 40, 512, 3000):
        assert perf.work_time(StepWork(n, 1, 1, n * (n + 1) / 2, n, n)) == pytest.approx(table.seconds(n))


def test_the_router_mode_travels_one_way():
    with pytest.raises(ValueError, match="router_mode"):
        ControllerOptions(1.0, 0.1, router={"mode": "reference"})
    assert ControllerOptions(1.0, 0.1, router_mode="reference").router_config().holds_output
    with pytest.raises(ValueError, match="fixed_interval, paper, paper-strict, reference"):
        RouterConfig(1.0, 0.1, mode="orca")
