"""Engine options: one `EngineArgs` gives the keyword arguments, the flags and the typed configs, and every
field survives the trip through the command line."""
import argparse
import dataclasses
import typing

import pytest

from ecoserve.config import CacheConfig, EngineArgs, EngineConfig, SchedulerConfig, SpeculativeConfig
from ecoserve.engine.llm import LLM

FIELDS = dataclasses.fields(EngineArgs)
RENAMED = {"scheduling_policy": "policy", "grammar_compile_timeout_s": "compile_timeout_s",
           "grammar_cache_size": "cache_size", "kv_cache_dtype": "cache_dtype"}  # EngineArgs name -> the typed config's


def non_default(f: dataclasses.Field) -> typing.Any:
    """A value of field `f` other than its default, read from its type and flag."""
    if isinstance(f.default, bool):
        return not f.default
    if f.name == "speculative_config":
        return '{"method": "ngram", "num_speculative_tokens": 2}'
    if f.name == "quantization":
        return "w8a8"  # the one quantization quantize_lm_head goes with
    choices = f.metadata["flag"].choices
    if choices:
        return next(c for c in choices if c != f.default)
    hint = typing.get_type_hints(EngineArgs)[f.name]
    args = typing.get_args(hint)
    base = next(a for a in args if a is not type(None)) if type(None) in args else hint
    if base in (int, float):
        return (f.default or 1) + 1
    if base is str:
        return f"{f.name}-set"
    if base == tuple[int, ...]:
        return (2, 1)
    raise AssertionError(f"no non-default value for EngineArgs.{f.name} ({hint}): teach non_default its type")


def every_field_set() -> EngineArgs:
    """EngineArgs with each field away from its default (a field added later is in it too)."""
    return EngineArgs(**{f.name: non_default(f) for f in FIELDS})


def parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_defaults_are_the_typed_configs_and_need_no_flag():
    assert EngineArgs().create_engine_config() == EngineConfig()
    assert EngineArgs().to_cli_args() == []
    assert parse([]) == EngineArgs()


def test_every_field_survives_the_command_line():
    args = every_field_set()
    assert parse(args.to_cli_args()) == args


@pytest.mark.parametrize("f", FIELDS, ids=[f.name for f in FIELDS])
def test_each_field_is_one_flag_that_round_trips(f):
    args = EngineArgs(**{f.name: non_default(f)})
    flags = args.to_cli_args()
    assert flags[0] == f.metadata["flag"].names[0] and len(flags) in (1, 2)
    assert parse(flags) == args


def test_every_field_reaches_the_typed_config():
    args = every_field_set()
    config = args.create_engine_config()
    flat = {k: v for k, v in vars(config).items() if not dataclasses.is_dataclass(v)}
    for part in (config.cache, config.scheduler, config.parallel, config.structured_outputs, config.lora):
        flat.update(vars(part))
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    flat["enable_lora"] = config.lora is not None
    for f in FIELDS:
        if f.name != "speculative_config":
            assert flat[RENAMED.get(f.name, f.name)] == getattr(args, f.name), f.name


def test_flat_kwargs_land_in_the_right_config():
    cfg = EngineArgs("m", block_size=8, max_num_seqs=4, scheduling_policy="prefill_first",
                     enable_prefix_caching=False, dtype="bfloat16", max_waiting=3).create_engine_config()
    assert cfg.model == "m" and cfg.dtype == "bfloat16"
    assert cfg.cache.block_size == 8 and not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_seqs == 4 and cfg.scheduler.policy == "prefill_first"
    assert cfg.scheduler.max_waiting == 3


def test_flags_override_whatever_the_default():
    assert EngineArgs.flags(scheduling_policy="chunked", max_num_batched_tokens=2048) == [
        "--scheduling-policy", "chunked", "--max-num-batched-tokens", "2048"]


def test_today_flag_names_and_aliases_parse():
    args = parse(["-tp", "2", "-pp", "2", "--pp-layer-partition", "3,1", "--no-enable-prefix-caching",
                  "--max-waiting-requests", "5", "--num-gpu-blocks", "64"])
    assert args == EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2, pp_layer_partition=(3, 1),
                              enable_prefix_caching=False, max_waiting=5, num_gpu_blocks=64)


@pytest.mark.parametrize("build,field", [
    (lambda: CacheConfig(block_size=0), "block_size"),
    (lambda: CacheConfig(num_gpu_blocks=0), "num_gpu_blocks"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: SchedulerConfig(max_waiting=0), "max_waiting"),
    (lambda: EngineConfig(dtype="float8"), "dtype"),
    (lambda: CacheConfig(cache_dtype="fp8"), "kv_cache_dtype"),
    (lambda: LLM("m", no_such_option=1), "unknown engine option.*no_such_option"),
])
def test_invalid_options_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_a_bad_layer_partition_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse(["--pp-layer-partition", "3,x"])
    assert "pp_layer_partition must be comma-separated layer counts" in capsys.readouterr().err


def test_kv_cache_dtype_is_vllms_flag_and_reaches_the_cache_config():
    args = parse(["--kv-cache-dtype", "float32", "--dtype", "bfloat16"])
    assert args == EngineArgs(kv_cache_dtype="float32", dtype="bfloat16")
    assert args.to_cli_args() == ["--dtype", "bfloat16", "--kv-cache-dtype", "float32"]
    assert parse(args.to_cli_args()) == args
    assert args.create_engine_config().cache.cache_dtype == "float32"
    assert EngineArgs.from_kwargs("m", kv_cache_dtype="bfloat16").create_engine_config().cache.cache_dtype == \
        "bfloat16"
    with pytest.raises(SystemExit):
        parse(["--kv-cache-dtype", "fp8"])  # not a choice: argparse refuses it
