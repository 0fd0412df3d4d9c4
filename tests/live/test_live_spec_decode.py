"""`--speculative-config` on `ecoserve serve --strategy` reaches every instance as the same config; a bad one
stops the frontend before any instance starts."""
from __future__ import annotations

import argparse

import pytest

from ecoserve.cli import build_parser
from ecoserve.config import EngineArgs, SpeculativeConfig
from ecoserve.live import cli as live_cli
from ecoserve.live.serve import instance_engine_args

SPEC = '{"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def test_instances_get_the_speculative_config():
    args = build_parser().parse_args(["serve", "--strategy", "vllm", "--num-instances", "2",
                                      "--speculative-config", SPEC])
    flags = instance_engine_args(args).to_cli_args()
    parser = argparse.ArgumentParser()
    live_cli.add_parser(parser.add_subparsers())
    started = parser.parse_args(["instance", "--connect", "tcp://127.0.0.1:1", *flags])
    config = EngineArgs.from_cli_args(started).create_engine_config().speculative
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens="auto", prompt_lookup_max=4,
                                       prompt_lookup_min=2)


def test_a_bad_speculative_config_stops_the_frontend_before_any_instance():
    from ecoserve.live.serve import make_cluster_engine

    args = build_parser().parse_args(["serve", "--strategy", "vllm", "--speculative-config", '{"method": "eagle"}'])
    with pytest.raises(ValueError, match="method must be one of"):
        make_cluster_engine(args)
