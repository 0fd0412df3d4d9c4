"""How a request ends badly in the cluster (the server maps `EngineDeadError`s to OpenAI-shaped errors)."""
from __future__ import annotations

from ecoserve.engine.async_engine import EngineDeadError


class InstanceLostError(EngineDeadError):
    """The instance serving a request was lost after it had streamed tokens (or could not be replaced)."""


class RequestTimeoutError(EngineDeadError):
    """A request passed its deadline in the cluster."""


class UnroutableError(EngineDeadError):
    """The cluster controller could not place a request (e.g. every instance it could use is lost)."""
