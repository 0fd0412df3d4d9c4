"""Engine options: vLLM-style keyword arguments are sorted into typed configs and validated."""
import pytest

from ecoserve.config import CacheConfig, EngineConfig, SchedulerConfig
from ecoserve.engine.llm import engine_config_from_kwargs


def test_flat_kwargs_land_in_the_right_config():
    cfg = engine_config_from_kwargs("m", block_size=8, max_num_seqs=4, scheduling_policy="prefill_first",
                                    enable_prefix_caching=False, dtype="bfloat16", max_waiting=3)
    assert cfg.model == "m" and cfg.dtype == "bfloat16"
    assert cfg.cache.block_size == 8 and not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_seqs == 4 and cfg.scheduler.policy == "prefill_first"
    assert cfg.scheduler.max_waiting == 3


@pytest.mark.parametrize("build,field", [
    (lambda: CacheConfig(block_size=0), "block_size"),
    (lambda: CacheConfig(num_gpu_blocks=0), "num_gpu_blocks"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: SchedulerConfig(max_waiting=0), "max_waiting"),
    (lambda: EngineConfig(dtype="float8"), "dtype"),
    (lambda: engine_config_from_kwargs("m", no_such_option=1), "unknown engine option"),
])
def test_invalid_options_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()
