"""LLMEngine hardening: request ids, finished ids across empty steps, delta outputs, prompt logprobs."""
import pytest

from ecoserve.config import EngineArgs
from ecoserve.engine.llm_engine import SAMPLE_ID_SEP, LLMEngine
from ecoserve.sampling import SamplingParams
from tests.utils import make_tiny_checkpoint, prompts


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "m", "llama"))


@pytest.fixture
def engine(model_path) -> LLMEngine:
    return LLMEngine(EngineArgs(model_path, num_threads=1, max_model_len=256, num_gpu_blocks=64).create_engine_config())


def run_all(engine: LLMEngine) -> dict[str, list]:
    """Every output of every request, in order, until the engine is idle."""
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_sample_ids_cannot_collide_with_user_ids(engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    engine.add_request("2_r", [5, 6, 7], params)  # the id vLLM-style naming gives sample 2 of "r"
    engine.add_request("r", [5, 6, 7], params.clone(n=3))
    outs = run_all(engine)
    assert len(outs["2_r"]) == 4 and [len(o.outputs) for o in outs["r"]] == [3] * 4
    assert outs["r"][-1].finished and all(c.num_tokens == 4 for c in outs["r"][-1].outputs)
    with pytest.raises(ValueError, match="must not contain"):
        engine.add_request(f"x{SAMPLE_ID_SEP}0", [5], params)
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests


def test_refused_n_request_queues_no_sample(engine, monkeypatch):
    """Every sample is checked before any is queued: a refusal of the last leaves nothing behind."""
    check = engine.scheduler.check_request

    def refuse_third(req):
        check(req)
        if req.request_id.endswith(f"{SAMPLE_ID_SEP}2"):
            raise ValueError("refused")

    monkeypatch.setattr(engine.scheduler, "check_request", refuse_third)
    with pytest.raises(ValueError, match="refused"):
        engine.add_request("r", [5, 6, 7], SamplingParams(n=3, max_tokens=4))
    assert not engine.scheduler.requests and not engine.has_unfinished_requests() and engine.step() == []


def test_seeded_request_reproducible_when_its_id_is_reused(engine):
    """A finished id reaches the executor even when the next step schedules nothing, so a reused
    seeded id starts with a fresh generator."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    engine.add_request("s", [5, 6, 7, 8], params)
    first = run_all(engine)["s"][-1].outputs[0].token_ids
    assert engine.step() == []  # an empty step
    engine.add_request("s", [5, 6, 7, 8], params)
    assert run_all(engine)["s"][-1].outputs[0].token_ids == first
    assert not engine.executor._generators


def test_outputs_are_deltas_with_stable_cumulative_views(engine):
    engine.add_request("a", prompts(1, seed=4, min_len=20, max_len=20)[0],
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
    outs = run_all(engine)["a"]
    assert len(outs) == 24 and all(len(o.outputs[0].new_token_ids) == 1 for o in outs)
    final = outs[-1].outputs[0]
    assert [t for o in outs for t in o.outputs[0].new_token_ids] == final.token_ids
    assert "".join(o.outputs[0].new_text for o in outs) == final.text
    assert [lp for o in outs for lp in o.outputs[0].new_logprobs] == final.logprobs
    # an early output still shows what it showed then
    assert outs[2].outputs[0].token_ids == final.token_ids[:3] and len(outs[2].outputs[0].logprobs) == 3
    assert outs[2].outputs[0].text == final.text[:len(outs[2].outputs[0].text)]


def test_prompt_logprobs_survive_preemption(model_path):
    """Prompt positions recomputed after a preemption are not recorded twice."""
    ps = prompts(4, seed=9, min_len=90, max_len=120)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)

    def run(**kwargs):
        engine = LLMEngine(EngineArgs(model_path, num_threads=1, max_model_len=256,
                                      max_num_batched_tokens=64, **kwargs).create_engine_config())
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, params)
        return {rid: o[-1] for rid, o in run_all(engine).items()}

    tight, roomy = run(num_gpu_blocks=24), run(num_gpu_blocks=200)
    assert sum(o.metrics.num_preemptions for o in tight.values()) > 0
    for rid, out in tight.items():
        ref = roomy[rid].prompt_logprobs
        assert len(out.prompt_logprobs) == len(ps[int(rid)]) == len(ref) and out.prompt_logprobs[0] is None
        for got, want in zip(out.prompt_logprobs[1:], ref[1:]):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < 1e-3 for t in got)
