"""Typed, versioned messages between the frontend and its instances (msgspec over ZeroMQ).

One ordered ZeroMQ connection per instance carries both directions; every frame is one message,
tagged by its class name. `decode` never raises: a malformed or unknown frame is logged and
dropped by the caller (it gets None). KV blocks travel apart, as raw buffers (ecoserve.live.kv).
"""
from __future__ import annotations

import logging
from typing import Union

import msgspec

from ecoserve.cluster.status import InstanceStatus
from ecoserve.sampling import SamplingParams

logger = logging.getLogger(__name__)

# 2: AddRequest.num_output_tokens (a grammar continues on the decode leg); 3: Ready.max_step_ms; 4: Ready.engine;
# 5: Ready.kv_dtype, ExpectKV (an instance accepts only the KV transfers it was told to expect)
# 6: AddRequest.lora, InstanceStatus.loras / free_lora_slots, RequestFailed.refused (LoRA adapters load on
#    demand; routing prefers their holders; a bad adapter is the client's error)
PROTOCOL_VERSION = 6


class Msg(msgspec.Struct, tag=True, frozen=True):
    pass


# ---- frontend -> instance ---------------------------------------------------------------------
class Welcome(Msg):
    """The frontend accepted a `Ready`: this is the id the instance is known by."""

    instance_id: int


class LoRAAdapter(msgspec.Struct, frozen=True):
    """A LoRA adapter as the frontend registered it (the same id on every instance)."""

    name: str
    int_id: int
    path: str
    base_model_name: str | None = None

    @classmethod
    def of(cls, lora) -> "LoRAAdapter":  # an ecoserve.request.LoRARequest
        return cls(lora.lora_name, lora.lora_int_id, lora.lora_path, lora.base_model_name)


class AddRequest(Msg):
    """Run a request. `pin_kv`: when it stops at `params.max_tokens`, keep its KV for an export.

    `imported_tokens` > 0: the KV of the first tokens was imported (`ImportedKV`) and is not recomputed.
    `num_output_tokens` > 0: the last ids of `prompt_token_ids` are output another instance produced
    (FuDG's decode leg, a migrated stream); a structured-output grammar is advanced over them before
    sampling, and the text continues after the first `num_output_chars` characters the client has.
    """

    dispatch_seq: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    pin_kv: bool = False
    imported_tokens: int = 0
    num_output_tokens: int = 0
    num_output_chars: int = 0
    lora: LoRAAdapter | None = None  # run through this adapter, loaded first if the instance lacks it


class Abort(Msg):
    """Forget these requests, and free any KV held for them (pinned for export, or imported)."""

    request_ids: list[str]


class SetWindow(Msg):
    """Open (or close) the instance's prefill window (the temporal policy's command)."""

    open: bool


class ExportKV(Msg):
    """Send a pinned request's KV to another instance's KV address, then drop it here."""

    request_id: str
    num_tokens: int
    dst_address: str
    transfer_id: int


class ExpectKV(Msg):
    """To the destination of a KV transfer, before the source is asked: accept this transfer (and no other)."""

    request_id: str
    transfer_id: int
    num_tokens: int
    src: int


class Ping(Msg):
    """The frontend's application heartbeat; instances watch their connection (ZMTP heartbeats) instead."""

    time: float


class Shutdown(Msg):
    pass


# ---- instance -> frontend ---------------------------------------------------------------------
class EngineSettings(msgspec.Struct, frozen=True):
    """The engine options an instance runs with, as it reports them (shown per instance by /cluster)."""

    scheduling_policy: str
    max_num_batched_tokens: int
    max_num_seqs: int
    quantization: str | None = None  # of the weights it loaded: None (float) | "gguf" | "int8"


class Ready(Msg):
    version: int
    model: str  # the model's identity; the frontend refuses an instance serving another one
    pid: int
    host: str
    kv_address: str  # where its KV receiver listens (FuDG imports)
    total_kv_tokens: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    profile: list[tuple[int, float]]  # tokens -> ms of one batched step (the router's prefill-time profile)
    mock: bool = False
    # the profile read at its full token budget: a step this long sends no heartbeat, which the frontend
    # must not take for a stall (on one CPU core a 2048-token step of a 135M model takes seconds)
    max_step_ms: float = 0.0
    engine: EngineSettings | None = None
    kv_dtype: str = ""  # the KV tensors' element type; with block_size and kv_bytes_per_token, the KV layout


class Status(Msg):
    """`status` reflects every `AddRequest` up to `last_dispatch_seq`; the frontend overlays the rest."""

    seq: int
    last_dispatch_seq: int
    status: InstanceStatus


class Delta(msgspec.Struct, array_like=True, frozen=True):
    """New tokens and text of one sample (`index`) of one request since the previous delta."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with a request's first delta only
    num_cached_tokens: int = 0


class Outputs(Msg):
    """All the deltas of one engine step, in one message."""

    deltas: list[Delta]
    step_time: float = 0.0


class Paused(Msg):
    """A `pin_kv` request stopped at its token limit; its KV for `num_tokens` tokens is pinned here."""

    request_id: str
    num_tokens: int


class ImportedKV(Msg):
    """The KV of `request_id` arrived here (sent by the destination) and sits in fresh blocks."""

    request_id: str
    transfer_id: int
    src: int
    nbytes: int


class RequestFailed(Msg):
    """The instance refused or lost a request (bad input, duplicate id, failed KV transfer).

    `refused`: the request itself was bad (a LoRA adapter the engine cannot load): the client's error."""

    request_id: str
    reason: str
    refused: bool = False


class Heartbeat(Msg):
    time: float


ToInstance = Union[Welcome, AddRequest, Abort, SetWindow, ExportKV, ExpectKV, Ping, Shutdown]
ToFrontend = Union[Ready, Status, Outputs, Paused, ImportedKV, RequestFailed, Heartbeat]

_encoder = msgspec.msgpack.Encoder()
_to_instance = msgspec.msgpack.Decoder(ToInstance)
_to_frontend = msgspec.msgpack.Decoder(ToFrontend)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes, side: str) -> Msg | None:
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
        logger.warning("dropped a malformed or unknown message to the %s (%d bytes): %s", side, len(frame), e)
        return None


def decode_to_instance(frame: bytes) -> Msg | None:
    return _decode(_to_instance, frame, "instance")


def decode_to_frontend(frame: bytes) -> Msg | None:
    return _decode(_to_frontend, frame, "frontend")
