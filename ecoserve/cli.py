"""`ecoserve generate | serve | bench throughput | bench serve | simulate`."""
from __future__ import annotations

import argparse
import logging
import sys

from ecoserve.config import CPU_LINEARS, QUANTIZATIONS


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF dir, hub id or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="weight-only quantization on CPU, opt-in (default none: float weights); gguf: a .gguf model "
                        "keeps its Q4_0/Q4_1/Q8_0 blocks; int8: Q8_0 weights for HF checkpoints")
    p.add_argument("--cpu-linear", default="auto", choices=CPU_LINEARS,
                   help="float32 linear layers on CPU: oneDNN with prepacked weights (onednn), torch's F.linear "
                        "(torch), or auto (default): onednn where torch has it and one process holds the model")
    p.add_argument("--scheduling-policy", default="chunked")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks per pipeline stage")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--pp-layer-partition", default=None,
                   help="layers per stage, e.g. 12,11 (default: floor(L/pp) each, the remainder to the stages "
                        "before the last, which also runs the LM head)")
    p.add_argument("--max-concurrent-batches", type=int, default=None,
                   help="batches in flight (default: the pipeline parallel size)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, quantization=args.quantization, cpu_linear=args.cpu_linear,
                scheduling_policy=args.scheduling_policy,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, block_size=args.block_size,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=args.enable_prefix_caching,
                num_threads=args.num_threads, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size, pp_layer_partition=args.pp_layer_partition,
                max_concurrent_batches=args.max_concurrent_batches)


def _generate(args: argparse.Namespace) -> int:
    from ecoserve.engine.llm import LLM
    from ecoserve.sampling import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
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
    from ecoserve.engine.llm import engine_config_from_kwargs
    from ecoserve.engine.llm_engine import LLMEngine
    kwargs = engine_kwargs(args)
    kwargs["max_waiting"] = args.max_waiting_requests
    return run_server(args, AsyncEngine(LLMEngine(engine_config_from_kwargs(args.model, **kwargs))))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ecoserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="level of ecoserve's own log (libraries log warnings)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline")
    _add_engine_args(gen)
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
        serve = server_cli.add_parser(sub, _add_engine_args)
    except ImportError:
        pass
    else:
        from ecoserve.live.serve import add_cluster_args
        add_cluster_args(serve)
        serve.set_defaults(func=_serve)
    from ecoserve.live import cli as live_cli
    live_cli.add_parser(sub, _add_engine_args)
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
