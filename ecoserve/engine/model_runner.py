"""The real Executor: turns a SchedulerOutput into one flattened forward pass and samples.

One batch description per step (ids, positions, slot mapping, attention spans); no padding in
the token dimension. Logits are computed only for rows that are sampled (and for prompt rows of
requests that asked for prompt logprobs).

This is the one runner: the single-process engine calls it directly, and every rank of a
parallel instance runs it on the batch its `StepInput` rebuilds (ecoserve.distributed.step).
Grammar masks come in with the batch (the engine computes them at submit time), so the output
rank of a parallel instance samples constrained rows exactly as the single process does.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ecoserve.engine.attention import PagedAttention
from ecoserve.engine.kv_cache import PagedKVCache
from ecoserve.engine.guided import GrammarMasks
from ecoserve.engine.sampler import Sampler, SamplingRow, make_generator, prompt_logprobs
from ecoserve.sched.interface import SchedulerOutput, StepResult

if TYPE_CHECKING:
    from ecoserve.lora import LoRAManager


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: str = "cpu",
                 seed: int = 0, kv_cache_dtype: torch.dtype | None = None,
                 lora: "LoRAManager | None" = None) -> None:
        """`kv_cache_dtype`: the KV cache's element type (None: the model's dtype). `lora`: the engine's
        `ecoserve.lora.LoRAManager` (its modules wrap the model's) or None."""
        self.model = model
        self.lora = lora
        self.device = torch.device(device)
        cache_dtype = kv_cache_dtype or model.dtype
        self.kv_cache = PagedKVCache(model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim,
                                     cache_dtype, self.device)
        self.attention = PagedAttention(self.kv_cache)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        torch.manual_seed(seed)

    def _generator(self, request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = make_generator(seed, self.device)
        return gen

    def submit(self, batch: SchedulerOutput, masks: GrammarMasks | None = None) -> "ReadyStep":
        """The engine's one interface to executors (see ecoserve.distributed.executor): here the step runs now."""
        return ReadyStep(self.execute(batch, masks))

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, masks: GrammarMasks | None = None) -> StepResult:
        started = time.perf_counter()
        for rid in batch.finished_ids:
            self._generators.pop(rid, None)
        if batch.is_empty:
            return StepResult(duration=time.perf_counter() - started)
        ids, spans, sample_rows, prompt_rows = [], [], [], []
        offset = 0
        for chunk in batch.chunks:
            req = chunk.request
            end = chunk.start + chunk.num_tokens
            ids.extend(req.all_token_ids[chunk.start:end])
            spans.append((chunk.start, chunk.num_tokens, batch.block_tables[req.request_id], chunk.is_prefill))
            if req.sampling_params.prompt_logprobs is not None and chunk.start < req.num_prompt_tokens - 1:
                last = min(end, req.num_prompt_tokens - 1)  # positions whose next token is a prompt token
                prompt_rows.append((chunk, offset, last - chunk.start))
            if chunk.samples:
                sample_rows.append((chunk, offset + chunk.num_tokens - 1))
            offset += chunk.num_tokens
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(s, s + n) for s, n, _, _ in spans]).to(self.device)
        self.attention.meta = self.attention.build_metadata(spans)
        if self.lora is not None:  # each token's adapter slot, as the attention metadata
            self.lora.begin_step(batch.chunks)
        hidden = self.model(input_ids, positions, self.attention)
        self.attention.meta = None

        result = StepResult()
        if self.model.lm_head is None:  # an earlier pipeline stage: its hidden states went on to the next
            result.duration = time.perf_counter() - started
            return result
        logits = None
        if sample_rows:  # under tensor parallelism only rank 0 gets the gathered logits (None elsewhere)
            logits = self.model.compute_logits(hidden[torch.tensor([i for _, i in sample_rows])])
        if logits is not None:
            if masks is not None:  # tokens a grammar forbids get -inf before sampling (as vLLM)
                masks.apply(logits, [c.request.request_id for c, _ in sample_rows])
            rows = [SamplingRow.from_request(c.request, self._generator(c.request)) for c, _ in sample_rows]
            sampled = self.sampler(logits, rows)
            for k, (chunk, _) in enumerate(sample_rows):
                rid = chunk.request.request_id
                result.sampled[rid] = sampled.token_ids[k]
                if sampled.top_logprobs is not None and sampled.top_logprobs[k] is not None:
                    result.logprobs[rid] = sampled.top_logprobs[k]
                    result.sampled_logprob[rid] = sampled.sampled_logprobs[k]
        for chunk, offset, n in prompt_rows:
            req = chunk.request
            logits = self.model.compute_logits(hidden[offset:offset + n])
            if logits is None:
                continue
            targets = torch.tensor(req.prompt_token_ids[chunk.start + 1:chunk.start + 1 + n])
            result.prompt_logprobs[req.request_id] = prompt_logprobs(logits, targets,
                                                                     req.sampling_params.prompt_logprobs)
        result.duration = time.perf_counter() - started
        return result


class ReadyStep:
    """A step that already ran: the in-process runner's answer to `submit` (the future's interface)."""

    __slots__ = ("_result",)

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self) -> StepResult:
        return self._result
