"""`ecoserve serve --strategy ...`: a frontend over N instance processes, on the same controllers as the simulator.

The strategy's controller (ecoserve.cluster.strategies) says what each instance runs (`setups`:
its scheduling policy and token budget); the launcher starts those instances; the controller
itself is built once they have joined, from the tokens -> time profile they measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ecoserve.clock import WallClock
from ecoserve.cluster.router import ROUTER_MODES
from ecoserve.cluster.strategies import STRATEGIES, ControllerOptions, build_controller, setups_for
from ecoserve.config import EngineArgs, SpeculativeConfig

if TYPE_CHECKING:  # the frontend imports the engine (torch); `ecoserve instance` must not need it
    from ecoserve.engine.async_engine import ModelFacts
    from ecoserve.live.auth import ClusterAuth
    from ecoserve.live.frontend import ClusterEngine
    from ecoserve.live.shared import FrontendOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveCluster:
    """What `ecoserve serve --strategy` starts."""

    strategy: str
    num_instances: int = 2
    num_free_instances: int = 0  # ecoserve mitosis: a pool started at launch, added on demand
    controller: dict = field(default_factory=dict)  # more ControllerOptions fields (pd, balance, router_mode, ...)
    instance_args: tuple[str, ...] = ()  # engine arguments every instance gets (--model, --num-threads, ...)
    launcher: str = "local"  # | "ray"
    ray_address: str | None = None
    ray_num_cpus: float = 1.0
    ray_num_gpus: float = 0.0
    instance_log_dir: str | None = None
    cluster_auth: str = "curve"  # | "none"
    cluster_key_dir: str | None = None  # None: a fresh key set per run

    def options(self, ttft_slo: float, tpot_slo: float, max_num_batched_tokens: int) -> ControllerOptions:
        extra = dict(self.controller)
        if self.num_free_instances:
            extra.setdefault("total_instances", self.num_instances + self.num_free_instances)
        return ControllerOptions(ttft_slo, tpot_slo, num_instances=self.num_instances,
                                 max_num_batched_tokens=max_num_batched_tokens, **extra)


def build_cluster(model: ModelFacts, spec: LiveCluster, options: ControllerOptions,
                  frontend: FrontendOptions | None = None, num_threads: int | None = 1,
                  identity: str | None = None) -> ClusterEngine:
    """The ClusterEngine for `spec`: instances to launch with their setups, and the controller factory.

    `identity`: the model name the instances report (default: the model's)."""
    from ecoserve.live.frontend import ClusterEngine
    from ecoserve.live.shared import FrontendOptions
    clock = WallClock()
    setups = setups_for(spec.strategy, options)  # what to launch

    def args_for(iid: int) -> list[str]:
        s = setups[iid]
        budget = s.max_num_batched_tokens or options.max_num_batched_tokens
        return [*spec.instance_args, *EngineArgs.flags(scheduling_policy=s.policy, max_num_batched_tokens=budget)]

    def factory(step_time, status_of):
        return build_controller(spec.strategy, options, clock, step_time, statuses=status_of)

    if spec.launcher not in ("local", "ray"):
        raise ValueError(f"--launcher must be 'local' or 'ray', got {spec.launcher!r}")
    auth, key_dir, owns_key_dir = cluster_keys(spec)
    if spec.launcher == "ray":
        from ecoserve.live.launchers import RayLauncher
        launcher = RayLauncher(args_for, spec.ray_address, spec.ray_num_cpus, spec.ray_num_gpus, auth=auth)
    else:
        from ecoserve.live.launchers import LocalLauncher
        env = {"OMP_NUM_THREADS": str(num_threads)} if num_threads else {}
        launcher = LocalLauncher(args_for, env, spec.instance_log_dir, key_dir, owns_key_dir)
    fe_options = dataclasses.replace(frontend or FrontendOptions(), auth=auth)
    return ClusterEngine(model, factory, sorted(setups), launcher, fe_options, identity=identity)


def cluster_keys(spec: LiveCluster) -> tuple[ClusterAuth | None, str | None, bool]:
    """The key set of a run: (keys, the directory local instances read them from, whether it is a temporary one).

    `--cluster-key-dir` names one; otherwise a fresh set (Ray: in memory; local: in a private temporary
    directory, mode 0700, that the launcher removes at shutdown)."""
    from ecoserve.live import auth

    if spec.cluster_auth == "none":
        logger.warning("--cluster-auth none: instances join unauthenticated and prompts, outputs and KV cross the "
                       "network in the clear; use it only to debug on one machine")
        return None, None, False
    if spec.cluster_auth != "curve":
        raise ValueError(f"--cluster-auth must be 'curve' or 'none', got {spec.cluster_auth!r}")
    if spec.cluster_key_dir:
        return auth.load(spec.cluster_key_dir), spec.cluster_key_dir, False
    if spec.launcher == "ray":
        return auth.new_key_set(), None, False
    key_dir = tempfile.mkdtemp(prefix="ecoserve-keys-")  # mode 0700
    return auth.generate(key_dir), key_dir, True


def _pd(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pd takes P:D, e.g. 1:2; got {text!r}") from None
    return p, d


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (with --strategy: a frontend over instance processes)")
    g.add_argument("--strategy", default=None, choices=STRATEGIES.names(),
                   help="serve from --num-instances instance processes with this strategy (default: one "
                        "in-process engine)")
    g.add_argument("--num-instances", type=int, default=2)
    g.add_argument("--pd", type=_pd, default=None, help="FuDG split P:D (distserve, mooncake)")
    g.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT SLO in seconds")
    g.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT SLO in seconds")
    g.add_argument("--balance", default="round_robin", choices=["round_robin", "least_loaded"], help="NoDG")
    g.add_argument("--router-mode", default="paper", choices=ROUTER_MODES.names(),
                   help="ecoserve: paper (our reading of Algorithm 1), paper-strict (Algorithm 1 as printed), "
                        "reference (the authors' released router) or fixed_interval (ablation); "
                        "docs/reproduction.md 'Router modes'")
    g.add_argument("--output-hold", default=None, choices=["on", "off"],
                   help="ecoserve: hold the active prefill instance's tokens (default: on in reference mode)")
    g.add_argument("--macro-sizes", default=None, help="ecoserve: instances per macro instance, e.g. 4,4")
    g.add_argument("--num-free-instances", type=int, default=0,
                   help="ecoserve mitosis: instances started as a free pool, added on demand")
    g.add_argument("--mitosis", default=None, metavar="N_LOWER:N_UPPER",
                   help="ecoserve: enable mitosis with these macro-instance bounds")
    g.add_argument("--chunk-size", type=int, default=512, help="sarathi: token budget per hybrid step")
    g.add_argument("--launcher", default="local", choices=["local", "ray"])
    g.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start Ray locally)")
    g.add_argument("--instance-bind", default="tcp://127.0.0.1:0",
                   help="the frontend's instance port (0: any free port; use a routable host for other nodes)")
    g.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds of silence before an instance is lost")
    g.add_argument("--request-timeout", type=float, default=600.0, help="every request ends by then (seconds)")
    g.add_argument("--max-migrations", type=int, default=2, metavar="K",
                   help="a started stream whose instance is lost continues on another one at most K times, then "
                        "ends with an error (0: it ends at once)")
    g.add_argument("--max-instance-restarts", type=int, default=5, metavar="N",
                   help="restart a lost launched instance at most N times (0: lost instances stay lost)")
    g.add_argument("--instance-restart-backoff", type=float, default=1.0, metavar="S",
                   help="seconds before the first restart of an instance, doubling with each (capped at 30 s)")
    g.add_argument("--mock-profile", default=None, metavar="FILE",
                   help="instances run no model: they sleep this tokens,ms profile's step time")
    g.add_argument("--instance-log-dir", default=None)
    g.add_argument("--cluster-auth", default="curve", choices=["curve", "none"],
                   help="CURVE on every frontend<->instance and KV connection (default, loopback too), or none "
                        "to debug on one machine")
    g.add_argument("--cluster-key-dir", default=None, metavar="DIR",
                   help="the cluster's key set (`ecoserve keys generate DIR`); default: a fresh set per run")


def cluster_from_args(args: argparse.Namespace, engine_args: list[str]) -> tuple[LiveCluster, ControllerOptions]:
    ctrl: dict = {"balance": args.balance, "router_mode": args.router_mode, "chunk_size": args.chunk_size}
    if args.pd is not None:
        if sum(args.pd) != args.num_instances:
            raise ValueError(f"--pd {args.pd[0]}:{args.pd[1]} needs --num-instances {sum(args.pd)}")
        ctrl["pd"] = args.pd
    if args.macro_sizes:
        ctrl["macro_sizes"] = tuple(int(x) for x in args.macro_sizes.split(","))
    if args.output_hold is not None:
        ctrl["router"] = {"output_hold": args.output_hold == "on"}
    if args.mitosis:
        lo, hi = (int(x) for x in args.mitosis.split(":"))
        ctrl["mitosis"] = {"n_lower": lo, "n_upper": hi}
    instance_args = list(engine_args)
    if args.mock_profile:
        instance_args += ["--mock-profile", args.mock_profile]
    spec = LiveCluster(args.strategy, args.num_instances, args.num_free_instances, ctrl, tuple(instance_args),
                       args.launcher, args.ray_address, instance_log_dir=args.instance_log_dir,
                       cluster_auth=args.cluster_auth, cluster_key_dir=args.cluster_key_dir)
    return spec, spec.options(args.slo_ttft, args.slo_tpot, args.max_num_batched_tokens)


def instance_engine_args(args: argparse.Namespace) -> EngineArgs:
    """What every instance of `ecoserve serve --strategy` runs: the command's engine arguments, one torch
    thread unless told, and no waiting-queue limit (the frontend holds the queue)."""
    engine = EngineArgs.from_cli_args(args)
    SpeculativeConfig.parse(engine.speculative_config)  # a bad --speculative-config stops here, before any instance
    return dataclasses.replace(engine, num_threads=engine.num_threads or 1, max_waiting=None)


def make_cluster_engine(args: argparse.Namespace) -> ClusterEngine:
    """`ecoserve serve --strategy`'s frontend: the model's facts (no weights), the instances, the controller."""
    from ecoserve.engine.async_engine import ModelFacts
    from ecoserve.live.shared import FrontendOptions
    from ecoserve.model.loader import load_model_info

    instance_args = instance_engine_args(args).to_cli_args()
    if args.served_model_name:
        instance_args += ["--served-model-name", args.served_model_name]
    spec, options = cluster_from_args(args, instance_args)
    loaded = load_model_info(args.model)
    model = ModelFacts.of(loaded, args.max_model_len or loaded.max_model_len)
    if args.max_instance_restarts < 0:
        raise ValueError(f"--max-instance-restarts must be >= 0, got {args.max_instance_restarts}")
    if not args.instance_restart_backoff > 0:
        raise ValueError(f"--instance-restart-backoff must be > 0 seconds, got {args.instance_restart_backoff}")
    fe_opts = FrontendOptions(bind=args.instance_bind, heartbeat_timeout_s=args.heartbeat_timeout,
                              request_timeout_s=args.request_timeout, max_waiting=args.max_waiting,
                              max_migrations=args.max_migrations,
                              max_restarts=args.max_instance_restarts,
                              restart_backoff_s=args.instance_restart_backoff)
    return build_cluster(model, spec, options, fe_opts, args.num_threads or 1, identity=args.served_model_name)
