"""Serving-benchmark metrics with vLLM's definitions and JSON keys; pure functions over request outputs.

TTFT: send -> first streamed token. TPOT per request: (e2el - ttft) / (output_tokens - 1), only for
requests with more than one token (request-weighted). ITL: every gap between streamed chunks, pooled
over all requests (token-weighted). E2EL: send -> last byte. All reported in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestOutput:
    """What the client measured for one request (times in seconds)."""

    prompt_len: int = 0
    output_tokens: int | None = None  # from the server's usage block; None: count from the text
    prompt_tokens: int | None = None  # the server's count (includes any chat template)
    success: bool = False
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # seconds since the benchmark started
    error: str = ""


def percentile_key(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (the key prefix vLLM's plotting scripts read)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (SLOs in ms)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput entries must look like ttft:MS, tpot:MS or e2el:MS; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name} must be a number of milliseconds, got {value!r}") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {value}")
    return slos


def output_len(out: RequestOutput, count_tokens: Callable[[str], int] | None = None) -> int:
    """Usage block if present, else the tokenizer on the text, else one token per streamed chunk."""
    if out.output_tokens is not None:
        return out.output_tokens
    if count_tokens is not None:
        return count_tokens(out.generated_text)
    return len(out.itl) + 1 if out.generated_text else 0


def _stats(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    stats = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    for p in percentiles:
        stats[percentile_key(p)] = float(np.percentile(ms, p))
    return stats


def _peak_output_rate(outputs: list[RequestOutput], lens: list[int]) -> float:
    """Most output tokens in any 1-second bucket; a chunk's tokens count at its arrival time."""
    buckets: dict[int, float] = {}
    for out, n in zip(outputs, lens):
        times = out.start_time + out.ttft + np.concatenate([[0.0], np.cumsum(out.itl)])
        for t in times:
            buckets[int(t)] = buckets.get(int(t), 0.0) + n / len(times)
    return max(buckets.values(), default=0.0)


def _peak_concurrency(outputs: list[RequestOutput]) -> int:
    events = sorted([(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs])
    level = peak = 0
    for _, step in events:  # at equal times ends (-1) sort first, so back-to-back requests do not overlap
        level += step
        peak = max(peak, level)
    return peak


def calculate_metrics(outputs: list[RequestOutput], duration: float, goodput_config: dict[str, float] | None = None,
                      percentiles: list[float] = (99,), count_tokens: Callable[[str], int] | None = None) -> dict:
    """The result dict: totals, throughputs, goodput, mean/median/std/pNN of every metric, per-request lists."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration}")
    done = [o for o in outputs if o.success]
    lens = [output_len(o, count_tokens) for o in done]
    ttfts = [o.ttft for o in done]
    tpots = [(o.latency - o.ttft) / (n - 1) for o, n in zip(done, lens) if n > 1]
    itls = [gap for o in done for gap in o.itl]
    e2els = [o.latency for o in done]

    good = len(done)
    if goodput_config:
        slo = {k: v / 1000 for k, v in goodput_config.items()}
        good = 0
        for o, n in zip(done, lens):
            tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0  # one token: no decode, meets any TPOT SLO
            good += (o.ttft <= slo.get("ttft", np.inf) and tpot <= slo.get("tpot", np.inf)
                     and o.latency <= slo.get("e2el", np.inf))

    total_in = sum(o.prompt_len for o in done)
    total_out = sum(lens)
    result: dict = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if goodput_config else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": _peak_output_rate(done, lens),
        "max_concurrent_requests": _peak_concurrency(outputs),
    }
    for name, values in zip(METRICS, (ttfts, tpots, itls, e2els)):
        for stat, value in _stats(values, list(percentiles)).items():
            result[f"{stat}_{name}_ms"] = value
    result.update({
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [output_len(o, count_tokens) if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    })
    return result


def format_table(result: dict, selected: list[str], percentiles: list[float], max_concurrency: int | None) -> str:
    """The console summary, laid out like vLLM's "Serving Benchmark Result" block."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"]))
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for name in selected:
        lines.append(f" {METRIC_TITLES[name]} ".center(width, "-"))
        label = name.upper()
        row(f"Mean {label} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {label} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            key = percentile_key(p)
            row(f"P{key[1:]} {label} (ms):", result[f"{key}_{name}_ms"])
    lines.append("=" * width)
    return "\n".join(lines)
