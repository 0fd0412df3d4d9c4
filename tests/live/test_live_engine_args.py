"""Every engine flag of `ecoserve serve --strategy` reaches every instance: unit-level for all of them, and a
2-instance cluster that reports (Ready, /cluster) the token budget, sequence limit and quantization it was given."""
from __future__ import annotations

import argparse
import dataclasses

import httpx
import pytest

from ecoserve.cli import build_parser
from ecoserve.config import EngineArgs
from ecoserve.live import cli as live_cli
from ecoserve.live.serve import instance_engine_args
from tests.live.conftest import MAX_MODEL_LEN, serve
from tests.test_config import every_field_set


def instance_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    live_cli.add_parser(parser.add_subparsers())
    return parser


def test_serve_gives_instances_every_engine_flag():
    every = every_field_set()
    args = build_parser().parse_args(["serve", "--strategy", "vllm", "--num-instances", "2", *every.to_cli_args()])
    instance = instance_engine_args(args)
    assert instance == dataclasses.replace(every, max_waiting=None)  # the frontend holds the waiting queue
    flags = instance.to_cli_args()
    for f in dataclasses.fields(EngineArgs):
        if f.name != "max_waiting":
            assert f.metadata["flag"].names[0] in flags, f.name
    started = instance_parser().parse_args(["instance", "--connect", "tcp://127.0.0.1:1", *flags])
    assert EngineArgs.from_cli_args(started) == instance


def test_instances_run_one_thread_unless_told():
    args = build_parser().parse_args(["serve", "--strategy", "vllm"])
    assert instance_engine_args(args) == EngineArgs(num_threads=1)


SETTINGS = {"max_num_batched_tokens": 384, "max_num_seqs": 8, "quantization": "int8"}


@pytest.fixture(scope="module")
def cluster(tiny_model):
    from ecoserve.live.serve import make_cluster_engine

    args = build_parser().parse_args([
        "serve", "--strategy", "vllm", "--num-instances", "2", "--model", tiny_model,
        "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks", "128", "--max-num-batched-tokens", "384",
        "--max-num-seqs", "8", "--quantization", "int8"])
    running = serve(make_cluster_engine(args))
    yield running
    running.stop()


def test_each_instance_runs_the_engine_flags_it_was_given(cluster):
    instances = cluster.cluster()
    assert len(instances) == 2
    for inst in instances:
        assert {k: inst["engine"][k] for k in SETTINGS} == SETTINGS, inst
    out = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                     json={"model": "tiny", "prompt": "Paris is the capital of", "max_tokens": 4, "temperature": 0})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4
