"""A started request that the driver resumes after its instance was lost: the controller routes it again as
a new arrival of prompt + output so far, with what is left of its budget (NoDG and FuDG)."""
from ecoserve.clock import VirtualClock
from ecoserve.cluster import RequestState
from ecoserve.cluster.events import (STAGING, Dispatch, FinishRequest, InstanceLost, PrefillDone, Resume,
                                     TransferDone, TransferKV)
from tests.cluster.test_controllers import FakeFleet, arrive, controller


def test_nodg_resumes_a_started_request_with_its_new_size():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = controller("vllm", clock, fleet)
    fleet.apply(arrive(c, "a", prompt=10, max_tokens=50))  # -> 0
    fleet.apply(arrive(c, "b", prompt=10, max_tokens=50))  # -> 1
    fleet.reqs[0]["a"] = RequestState("a", 0.0, 10, 0.5, 20)  # 20 tokens out
    acts = c.handle(InstanceLost(0, (Resume("a", 30, 30),)))
    assert len(acts) == 1 and acts[0].request_id == "a" and acts[0].instance_id != 0
    assert acts[0].max_tokens == 30 and c.requests["a"].prompt_len == 30
    fleet.apply(acts)
    # without a Resume, a started request ends as before
    where = acts[0].instance_id
    fleet.reqs[where]["a"] = RequestState("a", 0.0, 30, 0.7, 5)
    assert c.handle(InstanceLost(where)) == [FinishRequest("a", f"instance {where} was lost")]


def test_fudg_prefills_a_resumed_stream_again_and_forgets_its_staged_kv():
    clock = VirtualClock()
    fleet = FakeFleet(clock, free=10)  # no decode instance has room: the KV waits in staging
    c = controller("distserve", clock, fleet)
    fleet.apply(arrive(c, "a", prompt=100, max_tokens=40))
    assert c.handle(PrefillDone("a", 0, 100)) == [TransferKV("a", 0, STAGING, 100, 100_000.0)]
    assert c.handle(TransferDone("a", 0, STAGING, 100_000)) == []
    # its prefill instance is lost with the staged KV's source; the driver resumes it (1 token out)
    fleet.reqs[0]["a"] = RequestState("a", 0.0, 100, 0.5, 1)
    acts = c.handle(InstanceLost(0, (Resume("a", 101, 39),)))
    assert acts == [Dispatch("a", 1, 1)] and not c.staged  # prefill of prompt + output on the other prefill side
    assert c.handle(PrefillDone("a", 1, 101)) == [TransferKV("a", 1, STAGING, 101, 101_000.0)]
    fleet.free = {3: 1000}
    assert c.handle(TransferDone("a", 1, STAGING, 101_000)) == [Dispatch("a", 3, 38, imported_tokens=101)]
