"""Prometheus metrics with vLLM's names under an `ecoserve:` prefix (`vllm:` with --metrics-prefix vllm,
so vLLM's dashboards read them unchanged), label `model_name` on all.

Gauges and engine-wide counters are read from the engine when scraped; per-request histograms
are observed on the engine thread from each step's outputs (times from the engine's monotonic
clock, in seconds).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ecoserve.request import RequestOutput

if TYPE_CHECKING:
    from ecoserve.server.engine_client import EngineClient

DEFAULT_PREFIX = "ecoserve"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                  240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))  # vLLM's 1-2-5 series
_STEP_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


class ServerMetrics:
    """The /metrics registry, and the engine-thread observer that feeds its per-request histograms."""

    def __init__(self, engine: EngineClient, model_name: str, prefix: str = DEFAULT_PREFIX) -> None:
        """The engine's own series (scheduler and KV gauges, a cluster's per-instance ones) come from its collectors."""
        if not prefix.isidentifier():
            raise ValueError(f"the metrics prefix must be a word of letters, digits and _, got {prefix!r}")
        prefix += ":"
        self.prefix = prefix
        self.registry = CollectorRegistry()
        for collector in engine.metrics_collectors(model_name, prefix):
            self.registry.register(collector)
        self.registry.register(LoRACollector(engine, model_name, prefix))
        self.model_name = model_name

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(model_name)

        self.success = Counter(prefix + "request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        # vLLM v1 keeps both names: the per-token one (as the ITL) and a per-request mean
        self.tpot = hist("time_per_output_token_seconds", "Time per output token (each token after the first).",
                         _TPOT_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Per finished request: first to last token over the tokens after the first.",
                                 _TPOT_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", _PHASE_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to finish.", _PHASE_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "First scheduled to finish.", _PHASE_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per finished request (all samples).",
                            _TOKEN_BUCKETS)
        self.max_gen = hist("request_max_num_generation_tokens",
                            "Per finished request: the most tokens any one sample generated.", _TOKEN_BUCKETS)
        self.params_n = hist("request_params_n", "Samples per finished request (its n).", _N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "max_tokens of each accepted request.",
                                      _TOKEN_BUCKETS)
        self.step_tokens = hist("iteration_tokens_total",
                                "Tokens per engine step: new tokens, plus the uncached prompt of requests whose "
                                "first token came in that step.", _STEP_TOKEN_BUCKETS)
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens seen, time of the last one)

    def on_accepted(self, max_tokens: int | None, num_prompts: int) -> None:
        """Called by the server once a job's prompts are queued (the engine's outputs do not carry max_tokens)."""
        if max_tokens is not None:
            for _ in range(num_prompts):
                self.params_max_tokens.observe(max_tokens)

    # StepObserver, called on the engine thread
    def on_step(self, outputs: list[RequestOutput]) -> None:
        step_tokens = 0
        for out in outputs:
            step_tokens += sum(len(c.new_token_ids) for c in out.outputs)
            m = out.metrics
            if m is None or m.first_token_time is None:
                continue
            num_tokens = out.outputs[0].num_tokens
            seen = self._seen.get(out.request_id)
            if seen is None:
                step_tokens += max(0, len(out.prompt_token_ids) - out.num_cached_tokens)
                self.ttft.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue.observe(m.first_scheduled_time - m.arrival_time)
                    self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            elif num_tokens > seen[0] and m.last_token_time is not None:
                gap = (m.last_token_time - seen[1]) / (num_tokens - seen[0])
                for _ in range(num_tokens - seen[0]):
                    self.itl.observe(gap)
                    self.tpot.observe(gap)
            if out.finished:
                self._seen.pop(out.request_id, None)
                self._observe_finished(out)
            else:
                self._seen[out.request_id] = (num_tokens, m.last_token_time or m.first_token_time)
        if step_tokens:
            self.step_tokens.observe(step_tokens)

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        assert m is not None and m.first_token_time is not None
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            self.decode.observe(m.finished_time - m.first_token_time)
            if m.first_scheduled_time is not None:
                self.inference.observe(m.finished_time - m.first_scheduled_time)
        lengths = [c.num_tokens for c in out.outputs]
        if m.last_token_time is not None and lengths[0] > 1:
            self.request_tpot.observe((m.last_token_time - m.first_token_time) / (lengths[0] - 1))
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.gen_len.observe(sum(lengths))
        self.max_gen.observe(max(lengths))
        self.params_n.observe(len(out.outputs))
        self.success.labels(self.model_name, out.outputs[0].finish_reason or "stop").inc()

    def on_abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._seen.pop(rid, None)
            self.success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoRACollector:
    """vLLM's `lora_requests_info` (labels: the running and the waiting adapters, comma-separated, and
    max_lora; value: when it was read, a Unix time) and counters of adapter loads and evictions (into host
    memory, and into the batch's device slots), read from the engine client's `lora_stats()` (a
    `ecoserve.lora.LoRAStats`) at scrape time; no series without --enable-lora."""

    COUNTERS = (("lora_adapter_loads", "LoRA adapters read from disk into host memory.", "num_loads"),
                ("lora_adapter_evictions", "LoRA adapters dropped from host memory (--max-cpu-loras).",
                 "num_evictions"),
                ("lora_slot_loads", "LoRA adapters loaded into a device slot of the batch.", "num_slot_loads"),
                ("lora_slot_evictions", "LoRA adapters that lost their device slot to another (--max-loras).",
                 "num_slot_evictions"))

    def __init__(self, engine: EngineClient, model_name: str, prefix: str) -> None:
        self.engine, self.model_name, self.prefix = engine, model_name, prefix

    def collect(self):
        stats = self.engine.lora_stats() if hasattr(self.engine, "lora_stats") else None
        if stats is None:
            return
        info = GaugeMetricFamily(self.prefix + "lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([self.model_name, ",".join(stats.running_lora_adapters),
                         ",".join(stats.waiting_lora_adapters), str(stats.max_lora)], time.time())
        yield info
        for name, doc, attr in self.COUNTERS:
            c = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], getattr(stats, attr))
            yield c
