"""Which started requests may migrate, and what a migration resets (the frontend's request record, no processes)."""
from ecoserve.live.messages import Delta
from ecoserve.live.requests import LiveRequest
from ecoserve.sampling import SamplingParams


def started(params: SamplingParams, tokens: int = 3) -> LiveRequest:
    req = LiveRequest("r", None, [5, 6, 7], params, arrival=0.0, deadline=100.0)
    req.apply(Delta("r", 0, list(range(tokens)), "ab\u00e9", logprobs=None, cumulative_logprob=-1.5), now=1.0)
    req.output()  # handed to the client
    return req


def test_a_plain_stream_may_migrate_until_its_limit():
    req = started(SamplingParams(max_tokens=10, temperature=1.0, seed=3))
    assert req.migration_refusal(2, 256) is None
    req.begin_migration(0)
    assert req.migration_refusal(2, 256) is None
    req.begin_migration(1)
    assert "at most 2" in req.migration_refusal(2, 256) and "--max-migrations" in req.migration_refusal(2, 256)
    assert "at most 0" in started(SamplingParams(max_tokens=10)).migration_refusal(0, 256)


def test_what_does_not_migrate_says_why():
    assert "n > 1" in started(SamplingParams(n=2, max_tokens=10)).migration_refusal(2, 256)
    assert "penalties" in started(SamplingParams(max_tokens=10, presence_penalty=0.5)).migration_refusal(2, 256)
    assert "penalties" in started(SamplingParams(max_tokens=10, frequency_penalty=0.5)).migration_refusal(2, 256)
    assert "budget" in started(SamplingParams(max_tokens=3), tokens=3).migration_refusal(2, 256)
    assert "budget" in started(SamplingParams(max_tokens=None), tokens=3).migration_refusal(2, 6)


def test_a_migration_forgets_where_it_ran_and_keeps_what_the_client_has():
    req = started(SamplingParams(max_tokens=10, logprobs=1))
    req.transfer, req.kv_src, req.kv_dst, req.pending, req.continues = 4, 0, 1, object(), True
    req.begin_migration(1)
    assert (req.transfer, req.kv_src, req.kv_dst, req.pending, req.continues) == (None, None, None, None, False)
    assert req.lost_from == 1 and req.migrations == 1
    assert req.output_token_ids() == [0, 1, 2] and req.num_output_chars() == 3
    assert req.remaining_tokens(256) == 7
    # the next instance's logprob sum continues the first one's
    req.apply(Delta("r", 0, [9], "x", logprobs=[{9: -0.5}], cumulative_logprob=-0.5), now=2.0)
    assert req.samples[0].cumulative_logprob == -2.0
