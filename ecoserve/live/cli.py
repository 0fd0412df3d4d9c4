"""`ecoserve instance`: one instance process that connects to a cluster frontend."""
from __future__ import annotations

import argparse
import logging
from typing import Any

from ecoserve.config import EngineArgs

logger = logging.getLogger(__name__)


def run_instance(args: argparse.Namespace) -> int:
    from ecoserve.live.engines import MockEngine, RealEngine
    from ecoserve.live.instance import InstanceLoop, InstanceOptions

    e = EngineArgs.from_cli_args(args)
    if args.mock_profile:
        from ecoserve.model.default import DEFAULT_MODEL_NAME
        name = args.served_model_name or e.model or DEFAULT_MODEL_NAME  # a mock of the embedded default
        engine = MockEngine(args.mock_profile, name, e.scheduling_policy, e.num_gpu_blocks or 4096, e.block_size,
                            e.max_num_batched_tokens, e.max_num_seqs, e.max_model_len or 4096)
    else:
        from ecoserve.engine.llm_engine import LLMEngine
        engine = RealEngine(LLMEngine(e.create_engine_config()))
        if args.served_model_name:
            engine.model_name = args.served_model_name
    try:
        tokens = tuple(int(t) for t in args.profile_tokens.split(",") if t.strip())
        profile = engine.profile(tokens)
        opts = InstanceOptions(args.connect, args.kv_host, args.heartbeat_interval,
                               frontend_timeout_s=args.frontend_timeout)
        return InstanceLoop(engine, opts, profile).run()
    finally:
        engine.close()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("instance", help="one instance of a cluster (connects to `ecoserve serve --strategy`)",
                              description="Start one engine instance that joins the cluster frontend at --connect.")
    EngineArgs.add_cli_args(p)
    p.add_argument("--connect", required=True, help="the frontend's instance port, tcp://HOST:PORT")
    p.add_argument("--kv-host", default="127.0.0.1",
                   help="the address this instance's KV receiver binds, reachable by the other instances")
    p.add_argument("--served-model-name", default=None, help="the model identity reported to the frontend")
    p.add_argument("--mock-profile", default=None, metavar="FILE",
                   help="run no model: sleep each step for this `tokens,ms` CSV's predicted time and emit "
                        "placeholder tokens")
    p.add_argument("--profile-tokens", default="16,64,256",
                   help="prompt sizes timed at start-up: the tokens -> time profile sent to the router")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--frontend-timeout", type=float, default=5.0,
                   help="exit when the frontend has been silent this many seconds")
    p.set_defaults(func=run_instance)
    return p


def instance_main(argv: list[str]) -> int:
    """`ecoserve instance ARGV` without the rest of the command line (a Ray actor's entry point)."""
    parser = argparse.ArgumentParser(prog="ecoserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["instance", *argv])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ecoserve").setLevel(logging.INFO)
    return args.func(args)
