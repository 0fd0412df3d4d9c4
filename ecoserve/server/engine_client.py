"""The one surface the OpenAI server talks to: the in-process `AsyncEngine`, or a cluster frontend.

The server reads model facts, validates grammars, starts and aborts requests and follows the
engine's lifecycle only through this protocol; it never reaches into an engine's members.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

from ecoserve.engine.async_engine import ModelFacts, StepObserver
from ecoserve.request import RequestOutput
from ecoserve.sampling import SamplingParams
from ecoserve.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from ecoserve.request import LoRARequest


class EngineClient(Protocol):
    model: ModelFacts
    observer: StepObserver | None  # the server's per-request metrics; set before `start`
    dead_error: BaseException | None  # why the engine stopped serving, once it has

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start serving; called from the event loop that consumes the streams."""
        ...

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop; requests still streaming get an error."""
        ...

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests and fail those still running after `grace_s`; safe from a signal handler."""
        ...

    @property
    def is_running(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    def num_waiting(self) -> int: ...

    # ---- requests --------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's delta outputs, the last one `finished`; with `lora_request`, through that adapter (one
        `add_lora` registered). Raises at once on a bad request (ValueError), a dead engine, shutdown or a
        full queue; closing the stream early aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def check_grammar(self, spec: StructuredOutputsParams) -> None:
        """ValueError for a grammar the engine would refuse."""
        ...

    # ---- LoRA adapters (with --enable-lora) ---------------------------------------------------
    async def add_lora(self, lora: LoRARequest) -> None:
        """Make an adapter servable; ValueError (LoRAAdapterError) for one the engine cannot take."""
        ...

    async def remove_lora(self, lora_name: str) -> bool:
        """Drop an adapter; requests already running with it finish with it."""
        ...

    def lora_stats(self) -> Any:
        """The engine's `LoRAStats` (running and waiting adapters, max_lora, loads, evictions), None without LoRA."""
        ...

    # ---- metrics ---------------------------------------------------------------------------
    def metrics_collectors(self, model_name: str, prefix: str) -> list[Any]:
        """Prometheus collectors of the engine's own gauges and counters, named `prefix` + name."""
        ...
