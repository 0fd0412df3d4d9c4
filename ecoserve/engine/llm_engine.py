"""LLMEngine: requests in, scheduler + executor each step, RequestOutputs (with text) out."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ecoserve.clock import Clock, WallClock
from ecoserve.config import EngineConfig
from ecoserve.engine.attention import PagedKVCache
from ecoserve.engine.cpu import tune_allocator
from ecoserve.engine.detokenizer import IncrementalDetokenizer
from ecoserve.engine.model_runner import ModelRunner
from ecoserve.request import (CompletionOutput, Logprobs, Request, RequestMetrics, RequestOutput, RequestStatus)
from ecoserve.sampling import SamplingParams
from ecoserve.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
PromptType = str | list[int] | dict[str, Any]


@dataclass
class _Child:
    """One of the n samples of a user request, with its detokenizer and logprobs."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[Logprobs] | None
    cumulative_logprob: float | None
    num_processed: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.request.finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, clock: Clock | None = None, **kwargs: Any) -> None:
        from ecoserve.model.loader import load_model

        config = config or EngineConfig(**kwargs)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            tune_allocator()
        self.clock = clock or WallClock()
        loaded = load_model(config.model, dtype=config.dtype, device=config.device, revision=config.revision,
                            tokenizer=config.tokenizer, quantization=config.quantization)
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = config.scheduler.max_model_len or loaded.max_model_len
        model = loaded.model
        model.ensure_positions(self.max_model_len)
        block_size = config.cache.block_size
        per_token = PagedKVCache.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)
        # Default budget: 1 GiB, or less when even max_num_seqs requests at max_model_len need less.
        budget = config.cache.kv_cache_memory_bytes or min(
            DEFAULT_CPU_KV_BYTES, per_token * self.max_model_len * config.scheduler.max_num_seqs)
        num_blocks = config.cache.num_gpu_blocks or budget // (per_token * block_size)
        capacity = num_blocks * block_size
        if capacity < self.max_model_len:
            raise ValueError(f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}), fewer than "
                             f"max_model_len ({self.max_model_len}); raise the KV budget or lower max_model_len")
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); max concurrency at max_model_len %d: "
                    "%.2fx", num_blocks, block_size, capacity, capacity * per_token / 2**20, self.max_model_len,
                    capacity / self.max_model_len)
        self.num_kv_blocks = num_blocks
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.clock, self.max_model_len)
        self.executor = ModelRunner(model, num_blocks, block_size, config.device, config.seed)
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, _Parent] = {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}

    # ---- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len "
                             f"({self.max_model_len})")
        vocab = self.loaded.spec.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue; on error nothing is queued and other requests are untouched."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        arrival = self.clock.now() if arrival_time is None else arrival_time
        parent = _Parent(request_id, text, token_ids,
                         prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i,
                                            prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(rid, token_ids, child_params, arrival, self.eos_token_ids, self.max_model_len)
            parent.children.append(_Child(req, i, IncrementalDetokenizer(self.tokenizer, token_ids, child_params),
                                          [] if params.logprobs is not None else None,
                                          0.0 if params.logprobs is not None else None))
        for child in parent.children:
            self.scheduler.add_request(child.request)
            self._child_to_parent[child.request.request_id] = parent
        self._parents[request_id] = parent
        self.stats["prompt_tokens"] += len(token_ids)

    def abort_request(self, request_ids: str | list[str]) -> list[str]:
        """Abort unfinished requests and free their KV; returns the ids that were still unfinished."""
        aborted = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            self.scheduler.abort_requests([c.request.request_id for c in parent.children])
            for c in parent.children:
                self._child_to_parent.pop(c.request.request_id, None)
            aborted.append(rid)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        result = self.executor.execute(out)
        self.scheduler.update(out, result)
        touched: dict[str, _Parent] = {}
        for chunk in out.chunks:
            parent = self._child_to_parent.get(chunk.request.request_id)
            if parent is None:
                continue
            child = parent.children[0] if len(parent.children) == 1 else next(
                c for c in parent.children if c.request is chunk.request)
            rid = chunk.request.request_id
            if rid in result.prompt_logprobs and parent.prompt_logprobs is not None:
                have = len(parent.prompt_logprobs)
                new = result.prompt_logprobs[rid]
                skip = have - 1 - chunk.start  # positions already recorded before a preemption
                parent.prompt_logprobs.extend(new[max(skip, 0):])
            if rid in result.sampled:
                self._process_token(child, result)
                touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            outputs.append(self._make_output(parent))
            if parent.finished:
                del self._parents[parent.request_id]
                for c in parent.children:
                    self._child_to_parent.pop(c.request.request_id, None)
        return outputs

    def _process_token(self, child: _Child, result) -> None:
        req = child.request
        while child.num_processed < req.num_output_tokens:
            token = req.output_token_ids[child.num_processed]
            child.num_processed += 1
            self.stats["generation_tokens"] += 1
            if child.logprobs is not None and req.request_id in result.logprobs:
                child.logprobs.append(result.logprobs[req.request_id])
                child.cumulative_logprob += result.sampled_logprob[req.request_id]
            stop = child.detokenizer.append(token)
            if stop is not None and not req.finished and req.num_output_tokens >= req.sampling_params.min_tokens:
                req.stop_reason = stop
                self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs = []
        for c in parent.children:
            req = c.request
            reason = req.status.value if req.finished else None
            outs.append(CompletionOutput(c.index, c.detokenizer.text_so_far(final=req.finished),
                                         list(req.output_token_ids), c.cumulative_logprob,
                                         list(c.logprobs) if c.logprobs is not None else None, reason,
                                         req.stop_reason))
        first = parent.children[0].request
        times = first.times
        metrics = RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.last_token,
                                 times.finished, sum(c.request.num_preemptions for c in parent.children),
                                 first.num_cached_tokens)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None,
                             outs, parent.finished, metrics, first.num_cached_tokens)
