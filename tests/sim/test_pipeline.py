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
from ecoserve.request import Request
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


def test_simulate_tdpipe_writes_tp_pp_both_ways_and_tdpipe(tmp_path):
    args = build_parser().parse_args(["simulate", "tdpipe", "--out", str(tmp_path), "--num-requests", "150"])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "tdpipe.json").read_text())
    names = {"tp", "pp", "pp_ve", "pp_ve_64", "tdpipe"}
    assert set(data["throughput"]) == set(data["output_throughput"]) == set(data["runs"]) == names
    assert data["labels"]["pp"] == "PP, one scheduler" and data["labels"]["pp_ve"] == "PP, virtual engines"
    assert all(run["num_finished"] == 150 for run in data["runs"].values())
    assert all(len(data["runs"][n]["stage_utilisation"]) == 4 for n in names - {"tp"})
    assert data["ratios"]["tdpipe_over_pp_ve"] == pytest.approx(data["throughput"]["tdpipe"] / data["throughput"]["pp_ve"])
    assert all(v > 0 for v in data["throughput"].values())
    assert data["throughput"]["tdpipe"] > data["throughput"]["pp"]  # fewer bubbles than plain PP
    assert (tmp_path / "tdpipe.png").is_file()


def _engines(num_blocks=64, max_num_seqs=8, seats=None, pp=2, seconds=0.2, **cfg):
    perf = ParallelPerf(Constant(seconds), get_model("llama-2-13b"), pp=pp, link=LINK)
    config = SchedulerConfig(policy="prefill_first", max_num_batched_tokens=64, max_num_seqs=max_num_seqs, **cfg)
    return PipelineInstance(perf, config, num_blocks=num_blocks, virtual_engines=True, seats_per_engine=seats)


def test_virtual_engines_split_blocks_and_seats():
    inst = _engines(num_blocks=65, max_num_seqs=8, pp=4)
    assert len(inst.engines) == 4
    assert all(e.kv.num_blocks == 16 for e in inst.engines)  # 65 // 4, as vLLM divides num_gpu_blocks
    assert all(e.config.max_num_seqs == 2 for e in inst.engines)
    assert inst.in_flight_per_engine == 1
    vllm_seats = _engines(max_num_seqs=8, seats=8, pp=4)  # vLLM: max_num_seqs per virtual engine
    assert all(e.config.max_num_seqs == 8 for e in vllm_seats.engines)
    single = PipelineInstance(inst.perf, SchedulerConfig(policy="prefill_first", max_num_seqs=8), num_blocks=65)
    assert len(single.engines) == 1 and single.sched.kv.num_blocks == 65 and single.sched.config.max_num_seqs == 8


def test_virtual_engines_finish_every_request_each_in_one_engine():
    requests = [SimRequest(f"r{i}", 0.1 * (i % 7), 5 + 3 * i % 11, 1 + i % 5) for i in range(40)]
    inst = _engines(num_blocks=40, max_num_seqs=8, pp=4)
    seen: dict[str, set[int]] = {}
    batches_in_flight: list[int] = []
    submit = inst._submit

    def recording_submit(engine, now):
        batch = submit(engine, now)
        if batch is not None:
            for c in batch[2].chunks:
                seen.setdefault(c.request.request_id, set()).add(engine)
        return batch

    inst._submit = recording_submit
    run = inst.run(requests)
    assert run.num_finished == 40
    assert run.output_tokens == sum(r.output_len for r in requests)
    assert set(seen) == {r.request_id for r in requests}
    assert all(len(engines) == 1 for engines in seen.values())  # no request in two virtual engines
    assert {rid: next(iter(e)) for rid, e in seen.items()} == inst.engine_of
    assert not any(e.has_unfinished_requests() or e.in_flight for e in inst.engines)
    assert all(e.kv.num_free_blocks == e.kv.num_blocks for e in inst.engines)
    assert run.num_batches >= max(r.output_len for r in requests)
    assert run.stage_busy[0] == pytest.approx(run.stage_busy[1])


def test_arrivals_join_the_least_loaded_engine_in_turn():
    inst = _engines(pp=3, max_num_seqs=9)
    inst.run([SimRequest(f"r{i}", 0.0, 4, 30 if i == 0 else 1) for i in range(6)]
             + [SimRequest("late", 1.0, 4, 1)])
    # at t = 0 the loads are equal, so the six go round robin; at t = 1 only engine 0 still holds one (r0)
    assert [inst.engine_of[f"r{i}"] for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert inst.engine_of["late"] == 1


class Linear:
    """A single-GPU model whose step time grows with the tokens it computes."""

    def work_time(self, work):
        return 0.01 + 0.01 * work.num_tokens if work.num_tokens else 0.0


def test_one_batch_in_flight_per_virtual_engine():
    inst = _engines(num_blocks=64, max_num_seqs=8, pp=4)
    in_flight = [0] * 4
    most = [0] * 4
    for e, sched in enumerate(inst.engines):
        schedule, update = sched.schedule, sched.update

        def counting_schedule(e=e, schedule=schedule):
            out = schedule()
            if not out.is_empty:
                in_flight[e] += 1
                most[e] = max(most[e], in_flight[e])
            return out

        def counting_update(out, result, e=e, update=update):
            in_flight[e] -= 1
            return update(out, result)

        sched.schedule, sched.update = counting_schedule, counting_update
    run = inst.run([SimRequest(f"r{i}", 0.05 * i, 6, 4) for i in range(16)])
    assert run.num_finished == 16
    assert most == [1, 1, 1, 1] and in_flight == [0, 0, 0, 0]


def test_virtual_engines_fill_the_pipeline_where_one_scheduler_cannot():
    # eight decoding requests: one scheduler puts all of them in one batch and has nothing left for a second
    # batch until it is back (one batch in a 4-stage pipeline); four virtual engines keep four small batches in it
    requests = [SimRequest(f"r{i}", 0.0, 16, 40) for i in range(8)]
    perf = ParallelPerf(Linear(), get_model("llama-2-13b"), pp=4, link=LINK)
    config = SchedulerConfig(policy="prefill_first", max_num_batched_tokens=2048, max_num_seqs=256)
    single = PipelineInstance(perf, config, num_blocks=256).run(requests)
    engines = PipelineInstance(perf, config, num_blocks=256, virtual_engines=True, seats_per_engine=256).run(requests)
    assert single.num_finished == engines.num_finished == 8
    assert single.output_tokens == engines.output_tokens == 8 * 40
    assert engines.num_batches == 4 * single.num_batches
    assert len(single.batch_seqs) == single.num_batches and single.median_batch_seqs == 8
    assert engines.median_batch_seqs == 2
    assert engines.makespan < 0.6 * single.makespan
    assert engines.stage_busy[0] / engines.makespan > 1.5 * single.stage_busy[0] / single.makespan


def test_virtual_engines_preempt_where_one_scheduler_has_room():
    # 20 blocks hold the two long (8 blocks each) and two short (1 each) requests together, but round-robin
    # assignment puts both long ones in engine 0, whose half of the blocks (10) cannot hold them: preemptions
    requests = [SimRequest(f"r{i}", 0.0, 64 if i % 2 == 0 else 8, 64 if i % 2 == 0 else 8) for i in range(4)]
    perf = ParallelPerf(Linear(), get_model("llama-2-13b"), pp=2, link=LINK)
    config = SchedulerConfig(policy="prefill_first", max_num_batched_tokens=2048, max_num_seqs=256)
    single = PipelineInstance(perf, config, num_blocks=20).run(requests)
    inst = PipelineInstance(perf, config, num_blocks=20, virtual_engines=True, seats_per_engine=256)
    engines = inst.run(requests)
    assert [inst.engine_of[f"r{i}"] for i in range(4)] == [0, 1, 0, 1]
    assert single.num_preemptions == 0 and engines.num_preemptions > 0
    assert single.num_finished == engines.num_finished == 4
    assert single.output_tokens == engines.output_tokens == 2 * 64 + 2 * 8
