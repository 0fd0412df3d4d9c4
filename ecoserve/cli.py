"""`ecoserve generate | serve | bench throughput | bench serve | simulate | env`."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from ecoserve.config import EngineArgs


def _generate(args: argparse.Namespace) -> int:
    from ecoserve.engine.llm import LLM
    from ecoserve.sampling import SamplingParams

    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sample_seed)
    prompts = args.prompt or ["Hello, my name is"]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        print(f"> {prompt}\n{out.outputs[0].text.strip()}\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """`ecoserve serve`: the OpenAI server over one in-process engine, or (--strategy) over a cluster frontend."""
    from ecoserve.server.cli import run_server

    if args.strategy:
        from ecoserve.live.routes import cluster_router
        from ecoserve.live.serve import make_cluster_engine
        cluster = make_cluster_engine(args)
        return run_server(args, cluster, routers=[cluster_router(cluster)])
    from ecoserve.engine.async_engine import AsyncEngine
    from ecoserve.engine.llm_engine import LLMEngine
    return run_server(args, AsyncEngine(LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())))


def _keys_generate(args: argparse.Namespace) -> int:
    """`ecoserve keys generate DIR`: the key set for `--cluster-key-dir` (refuses to overwrite one)."""
    import os

    from ecoserve.live.auth import SERVER_NAME, generate

    if os.path.exists(os.path.join(args.dir, f"{SERVER_NAME}.key_secret")):
        raise ValueError(f"{args.dir} already holds a cluster key set")
    generate(args.dir)
    print(f"wrote a cluster key set to {args.dir}; pass --cluster-key-dir {args.dir} to `ecoserve serve` "
          f"and `ecoserve instance` (keep the .key_secret files private)")
    return 0


def _env(args: argparse.Namespace) -> int:
    """`ecoserve env`: the machine, the CPU capabilities in force and which path each kernel takes."""
    from ecoserve.kernels.paths import environment_report

    print(environment_report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ecoserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="level of ecoserve's own log (libraries log warnings)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from ecoserve.bench import latency, structured, throughput
    throughput.add_parser(bench)
    latency.add_parser(bench)
    structured.add_parser(bench)
    try:
        from ecoserve.bench import serve as bench_serve
        bench_serve.add_parser(bench)
    except ImportError:
        pass
    try:
        from ecoserve.server import cli as server_cli
        serve = server_cli.add_parser(sub)
    except ImportError:
        pass
    else:
        from ecoserve.live.serve import add_cluster_args
        add_cluster_args(serve)
        serve.set_defaults(func=_serve)
    from ecoserve.live import cli as live_cli
    live_cli.add_parser(sub)
    keys = sub.add_parser("keys", help="cluster keys").add_subparsers(dest="keys", required=True)
    gen_keys = keys.add_parser("generate", help="write a cluster key set (CURVE) for --cluster-key-dir",
                               description="Write a fresh cluster key set into DIR (mode 0700): server.key, "
                                           "client.key and their .key_secret files.")
    gen_keys.add_argument("dir", metavar="DIR")
    gen_keys.set_defaults(func=_keys_generate)
    env = sub.add_parser("env", help="the CPU capabilities and the path each kernel takes here",
                         description="Print this machine's CPU, what the capability probe reports at the level in "
                                     "force (ECOSERVE_CPU_ISA) and the path each op takes (native kernels build on "
                                     "first use).")
    env.set_defaults(func=_env)
    try:
        from ecoserve.sim import cli as sim_cli
        sim_cli.add_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ecoserve").setLevel(args.log_level.upper())
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
