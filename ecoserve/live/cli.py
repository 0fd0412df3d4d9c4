"""`ecoserve instance`: one instance process that connects to a cluster frontend."""
from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from ecoserve.config import EngineArgs

if TYPE_CHECKING:
    from ecoserve.live.auth import ClusterAuth

logger = logging.getLogger(__name__)


def instance_auth(args: argparse.Namespace) -> ClusterAuth | None:
    """The key set this instance presents: handed over by a launcher, or read from --cluster-key-dir (ValueError)."""
    from ecoserve.live.auth import load

    if args.cluster_auth == "none":
        logger.warning("--cluster-auth none: this instance's connections are neither authenticated nor encrypted")
        return None
    given = getattr(args, "cluster_keys", None)  # a Ray actor's call argument (never on a command line)
    if given is not None:
        return given
    if not args.cluster_key_dir:
        raise ValueError("--cluster-auth curve (the default) needs the cluster's keys: --cluster-key-dir DIR "
                         "(written by `ecoserve keys generate DIR`), or --cluster-auth none to debug on one machine")
    return load(args.cluster_key_dir)


def run_instance(args: argparse.Namespace) -> int:
    from ecoserve.live.engines import MockEngine, RealEngine
    from ecoserve.live.instance import InstanceLoop, InstanceOptions

    auth = instance_auth(args)
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
                               reconnect_window_s=args.reconnect_window, kv_send_timeout_s=args.kv_send_timeout,
                               auth=auth)
        loop = InstanceLoop(engine, opts, profile)
    except BaseException:
        engine.close()
        raise
    return loop.run()  # it closes the engine (a parallel instance's ranks) before its connection


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from ecoserve.cluster.profile import PROFILE_TOKENS

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
    p.add_argument("--profile-tokens", default=",".join(map(str, PROFILE_TOKENS)),
                   help="prompt sizes timed at start-up: the tokens -> time profile sent to the router")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--reconnect-window", type=float, default=10.0,
                   help="exit when the connection to the frontend has been down this many seconds")
    p.add_argument("--kv-send-timeout", type=float, default=5.0,
                   help="a KV export that cannot reach its destination within this many seconds fails")
    p.add_argument("--cluster-auth", default="curve", choices=["curve", "none"],
                   help="CURVE on the frontend and KV connections (default), or none (debugging on one machine)")
    p.add_argument("--cluster-key-dir", default=None, metavar="DIR",
                   help="the cluster's key set (`ecoserve keys generate DIR`, or the frontend's --cluster-key-dir)")
    p.set_defaults(func=run_instance)
    return p


def instance_main(argv: list[str], auth: ClusterAuth | None = None) -> int:
    """`ecoserve instance ARGV` without the rest of the command line (a Ray actor's entry point);
    `auth`: the cluster's key set (a `ClusterAuth`), handed over in memory."""
    parser = argparse.ArgumentParser(prog="ecoserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["instance", *argv])
    args.cluster_keys = auth
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ecoserve").setLevel(logging.INFO)
    return args.func(args)
