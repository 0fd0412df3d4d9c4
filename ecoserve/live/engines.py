"""What an instance process runs: the real LLMEngine, or a mock that sleeps a profile's step time.

Both speak in `Delta`s (the new tokens and text of each request since its last step), expose
their `Scheduler` (status, windows, KV pins and imports) and read and write KV blocks as raw
buffers for transfers. Neither knows about sockets.
"""
from __future__ import annotations

import logging
import time

from ecoserve.live.messages import AddRequest, Delta, LoRAAdapter
from ecoserve.request import Request, RequestOutput
from ecoserve.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


class RequestRefusedError(ValueError):
    """An engine refused a request for its own content (a LoRA adapter it cannot load): the client's error."""


def deltas_of(out: RequestOutput, with_prompt_logprobs: bool) -> list[Delta]:
    """The engine's delta output of one step as messages (samples without news are left out)."""
    return [Delta(out.request_id, c.index, list(c.new_token_ids), c.new_text, c.finish_reason, c.stop_reason,
                  c.new_logprobs, c.cumulative_logprob, out.prompt_logprobs if with_prompt_logprobs else None,
                  out.num_cached_tokens)
            for c in out.outputs if c.new_token_ids or c.new_text or c.finish_reason is not None]


def _import(sched: Scheduler, msg: AddRequest) -> None:
    """A request whose first tokens' KV was imported adopts those blocks before it is scheduled."""
    if not msg.imported_tokens:
        return
    req = sched.requests[msg.request_id]
    if not sched.kv.adopt(req, msg.imported_tokens):
        sched.abort_requests([msg.request_id])
        raise ValueError(f"request {msg.request_id!r}: no imported KV of {msg.imported_tokens} tokens is held here")


class RealEngine:
    """An LLMEngine (a real model) behind the instance protocol."""

    mock = False

    def __init__(self, engine) -> None:  # ecoserve.engine.llm_engine.LLMEngine
        self.engine = engine
        self.scheduler: Scheduler = engine.scheduler
        self._prompt_logprobs_sent: set[str] = set()
        self.kv_cache = getattr(engine.executor, "kv_cache", None)  # None: a parallel instance's KV is in its ranks
        self.block_size = engine.config.cache.block_size
        self.kv_bytes_per_token = engine.kv_bytes_per_token()
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.quantization = engine.loaded.quantization
        self.kv_dtype = str(engine.kv_cache_dtype).removeprefix("torch.")
        self._loras: dict[str, int] = {}  # adapters this instance loaded for the frontend: name -> id

    def kv_frame_sizes(self, num_blocks: int) -> list[int]:
        """The frames a transfer of `num_blocks` blocks carries: K and V, each half the KV bytes."""
        half = num_blocks * self.block_size * self.kv_bytes_per_token // 2
        return [half, half]

    def add(self, msg: AddRequest) -> None:
        """Queue a request (ValueError for bad input or a duplicate id; nothing changes then)."""
        # a decode leg's grammar starts where the other instance left it: after the outputs at the prompt's end
        carried = msg.prompt_token_ids[-msg.num_output_tokens:] if msg.num_output_tokens else ()
        adapter = {"lora_request": self._lora(msg.lora)} if msg.lora is not None else {}
        self.engine.add_request(msg.request_id, {"prompt": msg.prompt, "prompt_token_ids": msg.prompt_token_ids},
                                msg.params, grammar_accepted=carried, **adapter)
        if msg.num_output_tokens:  # output produced elsewhere: the text goes on from what the client has
            self.engine.resume_output(msg.request_id, msg.num_output_tokens, msg.num_output_chars)
        if msg.pin_kv:
            self.scheduler.kv.pin(msg.request_id)
        try:
            _import(self.scheduler, msg)
        except ValueError:
            self.engine.abort_request(msg.request_id)
            raise

    def _lora(self, adapter: LoRAAdapter):
        """The adapter as a LoRARequest, loaded here first if this instance lacks it (or holds an older one of
        that name); RequestRefusedError (a ValueError) for one the engine refuses."""
        from ecoserve.request import LoRARequest

        lora = LoRARequest(adapter.name, adapter.int_id, adapter.path, adapter.base_model_name)
        held = self._loras.get(adapter.name)
        if held != adapter.int_id:
            if held is not None:
                self.engine.remove_lora(adapter.name)
                del self._loras[adapter.name]
            try:
                self.engine.add_lora(lora)
            except ValueError as e:  # LoRAAdapterError: the request's adapter, not this instance, is at fault
                raise RequestRefusedError(str(e)) from None
            self._loras[adapter.name] = adapter.int_id
        return lora

    def resident_loras(self) -> tuple[str, ...]:
        """The adapters loaded here (what adapter-affinity routing reads from the status)."""
        return tuple(self._loras)

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        self._prompt_logprobs_sent.difference_update(request_ids)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    @property
    def stuck(self) -> bool:
        """The last step could schedule nothing (e.g. prompts waiting for a window, or for their grammars, which
        the next step starts once compiled): the loop polls slowly instead of spinning."""
        return self.engine.last_step_empty

    def step(self) -> list[Delta]:
        deltas = []
        sent = self._prompt_logprobs_sent
        for out in self.engine.step():
            first = out.prompt_logprobs is not None and out.request_id not in sent
            if first:
                sent.add(out.request_id)
            if out.finished:
                sent.discard(out.request_id)
            deltas.extend(deltas_of(out, first))
        return deltas

    def take_failed(self) -> dict[str, str]:
        """Requests the last steps failed alone (already aborted here), with why."""
        failed = self.engine.take_failed()
        self._prompt_logprobs_sent.difference_update(failed)
        return {rid: str(error) for rid, error in failed.items()}

    def profile(self, token_counts: tuple[int, ...]) -> list[tuple[int, float]]:
        """Time one prefill of each size (the router's tokens -> time table); nothing stays queued."""
        from ecoserve.cluster.profile import profiling_lengths
        from ecoserve.sampling import SamplingParams
        rows = []
        vocab = self.engine.loaded.spec.vocab_size
        for n in profiling_lengths(self.scheduler.config.max_num_batched_tokens, self.max_model_len, token_counts):
            rid = f"__profile_{n}"
            ids = [(7 * i + n) % vocab for i in range(n)]
            started = time.perf_counter()
            self.engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))
            while self.engine.has_unfinished_requests():
                self.engine.step()
            rows.append((n, (time.perf_counter() - started) * 1e3))
        return sorted(set(rows))

    def check(self) -> None:
        """Raise if a rank of a parallel instance has died or stalled (nothing to check in one process)."""
        self.engine.check()

    def close(self) -> None:
        """Stop a parallel instance's rank processes."""
        self.engine.shutdown()

    # ---- KV blocks as raw buffers -----------------------------------------------------------
    def _local_cache(self):
        if self.kv_cache is None:
            raise NotImplementedError("KV transfer to or from a tensor/pipeline-parallel instance is not supported: "
                                      "its KV lives in the rank processes")
        return self.kv_cache

    def read_blocks(self, block_ids: list[int]) -> list[memoryview]:
        import torch
        self._local_cache()
        idx = torch.tensor(block_ids, dtype=torch.long)
        return [memoryview(t[:, idx].contiguous().numpy()).cast("B") for t in (self.kv_cache.k, self.kv_cache.v)]

    def write_blocks(self, block_ids: list[int], buffers: list[bytes | memoryview]) -> None:
        import torch
        self._local_cache()
        idx = torch.tensor(block_ids, dtype=torch.long)
        for t, buf in zip((self.kv_cache.k, self.kv_cache.v), buffers):
            shape = (t.shape[0], len(block_ids), *t.shape[2:])
            src = torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf, dtype=t.dtype).view(shape)
            t[:, idx] = src


class MockEngine:
    """The scheduler of a real instance over a simulated executor: sleeps the predicted step time.

    Emits `token_id` as every output token, with the placeholder text `text` each; stops only at the
    token limit. Lets tests and
    benchmarks run many instances on few cores with the real protocol and the real scheduler.
    """

    mock = True
    quantization = None  # no weights

    def __init__(self, profile_csv: str, model_name: str, policy: str, num_blocks: int = 4096,
                 block_size: int = 16, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 max_model_len: int = 4096, token_id: int = 0, text: str = "x ") -> None:
        from ecoserve.clock import WallClock
        from ecoserve.config import CacheConfig, SchedulerConfig
        from ecoserve.sim.instance import SimulatedExecutor
        from ecoserve.sim.perf import TablePerf

        self.perf = TablePerf.from_csv(profile_csv)
        self.executor = SimulatedExecutor(self.perf, token_id)
        self.scheduler = Scheduler(SchedulerConfig(policy, max_num_batched_tokens, max_num_seqs, max_model_len),
                                   CacheConfig(block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=False),
                                   num_blocks, WallClock(), max_model_len)
        self.block_size, self.kv_bytes_per_token, self.kv_dtype = block_size, 0, "none"
        self.model_name, self.max_model_len = model_name, max_model_len
        self._requests: dict[str, Request] = {}
        self.text = text
        self.stuck = False
        self._loras: dict[str, int] = {}  # adapters named by requests: "loaded" on first use, as a real one is

    def resident_loras(self) -> tuple[str, ...]:
        return tuple(self._loras)

    def add(self, msg: AddRequest) -> None:
        if msg.request_id in self._requests:
            raise ValueError(f"request id {msg.request_id!r} is already in use")
        if msg.lora is not None:
            self._loras[msg.lora.name] = msg.lora.int_id
        params = msg.params.clone(ignore_eos=True, n=1)
        req = Request(msg.request_id, list(msg.prompt_token_ids), params, time.monotonic())
        self.scheduler.add_request(req)
        self._requests[msg.request_id] = req
        if msg.pin_kv:
            self.scheduler.kv.pin(msg.request_id)
        try:
            _import(self.scheduler, msg)
        except ValueError:
            self._requests.pop(msg.request_id, None)
            raise

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self._requests.pop(rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[Delta]:
        out = self.scheduler.schedule()
        self.stuck = out.is_empty
        if out.is_empty:
            return []
        result = self.executor.execute(out)
        time.sleep(result.duration)
        self.scheduler.update(out, result)
        deltas = []
        for c in out.chunks:
            req = c.request
            if c.samples and req.request_id in self._requests and req.request_id in result.sampled:
                reason = req.status.value if req.finished else None
                deltas.append(Delta(req.request_id, 0, [result.sampled[req.request_id]], self.text, reason))
                if req.finished:
                    del self._requests[req.request_id]
        return deltas

    def take_failed(self) -> dict[str, str]:
        """A mock step fails no request on its own."""
        return {}

    def profile(self, token_counts: tuple[int, ...]) -> list[tuple[int, float]]:
        return self.perf.table.rows

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass

    def kv_frame_sizes(self, num_blocks: int) -> list[int]:
        return []  # no tensors: a transfer moves only the block count

    def read_blocks(self, block_ids: list[int]) -> list[memoryview]:
        return []

    def write_blocks(self, block_ids: list[int], buffers: list) -> None:
        pass
