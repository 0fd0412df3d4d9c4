"""`ecoserve bench serve`: load an OpenAI-compatible server with vLLM's serving-benchmark flags and metrics.

    ecoserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --num-prompts 100 --request-rate 4 --save-result

Arrivals: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)); burstiness 1 is Poisson,
smaller is burstier, larger more regular; rate inf sends everything at t=0. --max-concurrency caps
requests in flight with a client-side semaphore (a request's clock starts when it gets a slot).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from ecoserve.bench.client import BACKENDS, RequestInput, Sender
from ecoserve.bench.datasets import DATASETS, SampleRequest, load_tokenizer, sample_requests
from ecoserve.bench.metrics import METRICS, RequestOutput, calculate_metrics, format_table, parse_goodput


def gamma_intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """n inter-arrival gaps with mean 1/rate and coefficient of variation 1/sqrt(burstiness)."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start; the last lands at n/rate so the realized rate is the asked one."""
    if math.isinf(rate):
        return np.zeros(n)
    times = np.cumsum(gamma_intervals(n, rate, burstiness, rng))
    return times * (n / rate) / times[-1]


async def _dispatch(session: aiohttp.ClientSession, sender: Sender, inputs: list[RequestInput],
                    times: np.ndarray, max_concurrency: int | None,
                    disable_tqdm: bool) -> tuple[list[RequestOutput], float]:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(inputs), disable=disable_tqdm, desc="requests")
    t0 = time.perf_counter()

    async def one(req: RequestInput) -> RequestOutput:
        if sem is not None:
            async with sem:
                start = time.perf_counter() - t0
                out = await sender(session, req)
        else:
            start = time.perf_counter() - t0
            out = await sender(session, req)
        out.start_time = start
        bar.update(1)
        return out

    tasks = []
    for req, at in zip(inputs, times):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return list(outputs), duration


async def _ready_check(session: aiohttp.ClientSession, sender: Sender, req: RequestInput, timeout_s: float) -> None:
    """Send one request until it succeeds; a 4xx answer is a setup mistake and fails at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = await sender(session, req)
        if out.success:
            return
        if out.error.startswith("HTTP 4") or time.monotonic() > deadline:
            raise RuntimeError(f"the test request to {req.api_url} failed: {out.error}")
        await asyncio.sleep(1.0)


async def _first_model(base_url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base_url}/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]


def request_models(n: int, model: str, lora_modules: list[str] | None, seed: int) -> list[str]:
    """Each request's `model`: with `lora_modules` (vLLM's flag), one of those adapters drawn at random (seeded)."""
    if not lora_modules:
        return [model] * n
    picks = np.random.default_rng(seed + 1).integers(len(lora_modules), size=n)
    return [lora_modules[int(k)] for k in picks]


async def run_benchmark(args: argparse.Namespace, requests: list[SampleRequest], api_url: str,
                        sender: Sender) -> tuple[list[RequestOutput], float]:
    models = request_models(len(requests), args.model, getattr(args, "lora_modules", None), args.seed)
    inputs = [RequestInput(api_url, model, r.prompt, r.prompt_len, r.expected_output_len,
                           args.ignore_eos, args.temperature) for r, model in zip(requests, models)]
    times = arrival_times(len(inputs), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
    # limit=0: no connection cap of our own; --max-concurrency is the only client-side limit.
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if args.ready_check_timeout_sec > 0:
            await _ready_check(session, sender, inputs[0], args.ready_check_timeout_sec)
        return await _dispatch(session, sender, inputs, times, args.max_concurrency, args.disable_tqdm)


def _parse_list(text: str, flag: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if allowed is not None and s not in allowed]
    if bad or not items:
        raise ValueError(f"{flag} takes a comma-separated subset of {','.join(allowed or ())}; got {text!r}")
    return items


def _result_filename(args: argparse.Namespace) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = os.path.basename(str(args.model).rstrip("/"))
    return f"{args.backend}-{rate}qps{conc}-{model}-{datetime.now():%Y%m%d-%H%M%S}.json"


def main(args: argparse.Namespace) -> int:
    """Run the benchmark described by `args`; prints the table and optionally writes the JSON."""
    try:
        selected = _parse_list(args.percentile_metrics, "--percentile-metrics", METRICS)
        percentiles = [float(p) for p in _parse_list(args.metric_percentiles, "--metric-percentiles")]
        if not all(0 < p < 100 for p in percentiles):
            raise ValueError(f"--metric-percentiles must be in (0, 100), got {args.metric_percentiles!r}")
        goodput = parse_goodput(args.goodput)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        if args.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
        if args.burstiness <= 0:
            raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
        base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        sender, default_endpoint = BACKENDS[args.backend]
        api_url = base_url + (args.endpoint or default_endpoint)
        if args.model is None:
            args.model = asyncio.run(_first_model(base_url))
        tokenizer_id = args.tokenizer or args.model
        tokenizer = load_tokenizer(tokenizer_id)
        if tokenizer is None:
            print(f"note: no tokenizer loadable from {tokenizer_id!r}; "
                  "token counts come from the server's usage block", file=sys.stderr)
        requests = sample_requests(args, tokenizer, as_text=args.backend == "openai-chat")
    except (ValueError, aiohttp.ClientError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(f"Traffic: request rate {args.request_rate}, burstiness {args.burstiness}, "
          f"max concurrency {args.max_concurrency}, {len(requests)} prompts -> {api_url}")
    try:
        outputs, duration = asyncio.run(run_benchmark(args, requests, api_url, sender))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if tokenizer is None:  # our prompt lengths were estimates; the server knows the real ones
        for out in outputs:
            if out.prompt_tokens is not None:
                out.prompt_len = out.prompt_tokens
    count = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer is not None else None
    metrics = calculate_metrics(outputs, duration, goodput, percentiles, count)
    print(format_table(metrics, selected, percentiles, args.max_concurrency))

    if args.save_result:
        result: dict[str, Any] = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": args.backend,
            "endpoint": api_url,
            "model_id": args.model,
            "tokenizer_id": tokenizer_id if tokenizer is not None else None,
            "dataset_name": args.dataset_name,
            "num_prompts": args.num_prompts,
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "goodput_slos_ms": goodput or None,
            **metrics,
        }
        os.makedirs(args.result_dir or ".", exist_ok=True)
        path = os.path.join(args.result_dir or ".", args.result_filename or _result_filename(args))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"result written to {path}")
    if args.plot:
        plot_cluster_timeline(base_url, args.plot)
    return 0


def plot_cluster_timeline(base_url: str, path: str) -> bool:
    """`--plot`: fetch the cluster's `GET /cluster/timeline` and draw it; a single engine has none (skipped)."""
    import urllib.error
    import urllib.request

    from ecoserve.cluster.timeline import ClusterTimeline
    from ecoserve.sim.timeline_plot import plot_timeline

    try:
        with urllib.request.urlopen(f"{base_url}/cluster/timeline", timeout=30) as r:
            timeline = ClusterTimeline.from_json(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        if e.code == 404:
            print(f"--plot: {base_url} is not a cluster (no /cluster/timeline); no timeline to plot", file=sys.stderr)
        else:
            print(f"--plot: GET /cluster/timeline failed: {e}", file=sys.stderr)
        return False
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"--plot: GET /cluster/timeline failed: {e}", file=sys.stderr)
        return False
    plot_timeline(timeline, path, title=f"cluster timeline: {base_url}")
    print(f"cluster timeline written to {path}")
    return True


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` option names and defaults."""
    p.add_argument("--backend", choices=list(BACKENDS), default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions (both streaming)")
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="API path; default per backend")
    p.add_argument("--model", default=None, help="model name to send; default: the first of GET /v1/models")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves: each request names one, drawn at random (as vLLM's)")
    p.add_argument("--tokenizer", default=None,
                   help="local HF tokenizer dir (default: --model); if none loads, counts come from the usage block")
    p.add_argument("--dataset-name", choices=list(DATASETS), default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file for --dataset-name sharegpt")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)], r in [0, 1)")
    p.add_argument("--random-prefix-len", type=int, default=0, help="random tokens shared before every prompt")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at t=0")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so outputs have exact lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs a good request meets, e.g. ttft:500 tpot:50 e2el:10000")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="metrics printed, of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    p.add_argument("--save-result", action="store_true", help="write the result JSON")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="after the run, write a PNG of the cluster timeline (GET /cluster/timeline: phase per "
                        "instance, prefill windows, routed requests); skipped for a single engine")
    p.add_argument("--ready-check-timeout-sec", type=int, default=600,
                   help="retry a first test request this long while the server starts; 0 skips it")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` under a `bench` subcommand's subparsers; the parsed args carry func=main."""
    p = subparsers.add_parser("serve", help="benchmark an OpenAI-compatible server (vLLM bench serve flags)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    p.set_defaults(func=main)
    return p


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m ecoserve.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
