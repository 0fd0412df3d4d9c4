"""The simulator's pipeline executor (per-stage timelines, batches in flight) and `ecoserve simulate tdpipe`."""
import json

import pytest

from ecoserve.cli import build_parser
from ecoserve.config import SchedulerConfig
from ecoserve.sim.hardware import Link
from ecoserve.sim.models import model as get_model
from ecoserve.sim.network import allreduce_time
from ecoserve.sim.perf import StepWork
from ecoserve.sim.pipeline import ParallelPerf, PipelineInstance
from ecoserve.sim.workload import SimRequest

LINK = Link("test", 10e9, 1e-3, efficiency=1.0)


class Constant:
    """A single-GPU model whose every step takes `seconds` (split tp*pp ways by ParallelPerf)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def work_time(self, work):
        return self.seconds if work.num_tokens else 0.0


def test_stage_timelines_overlap_batches_in_flight():
    spec = get_model("llama-2-13b")
    perf = ParallelPerf(Constant(0.2), spec, pp=2, link=LINK)  # 0.1 s per stage
    hop = perf.send_time(8)
    assert hop == pytest.approx(1e-3 + 8 * spec.hidden_size * 2 / 10e9)
    # one request per batch, two batches in flight: A on stage 0 [0, .1], stage 1 [.1 + hop, .2 + hop];
    # B on stage 0 [.1, .2], stage 1 waits for A: [.2 + hop, .3 + hop]
    inst = PipelineInstance(perf, SchedulerConfig(policy="prefill_first", max_num_batched_tokens=8), num_blocks=64)
    run = inst.run([SimRequest("a", 0.0, 8, 1), SimRequest("b", 0.0, 8, 1)])
    assert run.num_finished == 2 and run.num_batches == 2
    assert run.makespan == pytest.approx(0.3 + hop)
    assert run.stage_busy == pytest.approx([0.2, 0.2])
    # one batch at a time: no overlap
    serial = PipelineInstance(perf, SchedulerConfig(policy="prefill_first", max_num_batched_tokens=8), num_blocks=64,
                              max_in_flight=1).run([SimRequest("a", 0.0, 8, 1), SimRequest("b", 0.0, 8, 1)])
    assert serial.makespan == pytest.approx(2 * (0.2 + hop))


def test_tensor_parallel_stage_adds_allreduces():
    spec = get_model("llama-2-13b")
    perf = ParallelPerf(Constant(0.4), spec, tp=4, link=LINK)
    work = StepWork(100, 100, 100, 0.0, 100)
    expected = 0.1 + 2 * spec.num_layers * allreduce_time(100 * spec.hidden_size * 2, 4, LINK)
    assert perf.stage_time(work) == pytest.approx(expected)
    assert perf.send_time(100) == 0.0


def test_arrivals_wait_for_their_time():
    perf = ParallelPerf(Constant(0.2), get_model("llama-2-13b"), pp=2, link=LINK)
    run = PipelineInstance(perf, SchedulerConfig(policy="chunked"), num_blocks=64).run(
        [SimRequest("a", 0.0, 8, 2), SimRequest("b", 5.0, 8, 1)])
    assert run.num_finished == 2 and run.makespan > 5.0


def test_simulate_tdpipe_writes_the_three_throughputs(tmp_path):
    args = build_parser().parse_args(["simulate", "tdpipe", "--out", str(tmp_path), "--num-requests", "150"])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "tdpipe.json").read_text())
    assert set(data["throughput"]) == {"tp", "pp", "tdpipe"}
    assert set(data["output_throughput"]) == {"tp", "pp", "tdpipe"}
    assert all(v > 0 for v in data["throughput"].values())
    assert data["throughput"]["tdpipe"] > data["throughput"]["pp"]  # fewer bubbles than plain PP
    assert (tmp_path / "tdpipe.png").is_file()
