"""The scheduler keeps at most max_loras adapters among running requests; others wait, base requests pass."""
import pytest

from ecoserve.clock import VirtualClock
from ecoserve.config import CacheConfig, SchedulerConfig
from ecoserve.request import LoRARequest, Request
from ecoserve.sampling import SamplingParams
from ecoserve.sched import Scheduler, StepResult

A, B, C = (LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abc"))


def make(policy, max_loras):
    return Scheduler(SchedulerConfig(policy=policy, max_num_batched_tokens=256), CacheConfig(block_size=4), 64,
                     VirtualClock(), max_model_len=100, max_loras=max_loras)


def request(rid, lora, max_tokens=3):
    return Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0,
                   lora_request=lora)


def step(sched):
    out = sched.schedule()
    sched.update(out, StepResult(sampled={c.request.request_id: 7 for c in out.chunks if c.samples}))
    return {c.request.request_id for c in out.chunks}


@pytest.mark.parametrize("policy", ["chunked", "prefill_first", "temporal", "tdpipe"])
def test_a_request_waits_while_its_adapter_has_no_slot(policy):
    sched = make(policy, max_loras=2)
    for rid, lora in [("a1", A), ("b1", B), ("c1", C), ("base", None), ("a2", A)]:
        sched.add_request(request(rid, lora, max_tokens=3 if rid != "a1" else 6))
    first = step(sched)
    assert first == {"a1", "b1", "base", "a2"}  # c waits; the base request and a's second pass it
    assert set(sched.running_loras) == {1, 2}
    seen_c = None
    for n in range(2, 10):
        ran = step(sched)
        assert len(sched.running_loras) <= 2
        if "c1" in ran:
            seen_c = n
            break
    assert seen_c is not None and "b1" not in {r.request_id for r in sched.running}  # c ran once b finished
    while sched.has_unfinished_requests():
        step(sched)
    assert not sched.running_loras


def test_without_lora_nothing_is_counted():
    sched = make("chunked", max_loras=None)
    sched.add_request(request("x", None))
    assert step(sched) == {"x"} and not sched.running_loras


def test_lora_ids_and_names_are_checked():
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/p")
    assert request("r", A).lora_id == 1 and request("r", None).lora_id == 0
