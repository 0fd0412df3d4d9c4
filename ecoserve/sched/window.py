"""The prefill window of an instance: the one definition of EcoServe's temporal phases.

The macro-instance scheduler opens an instance's window when its rolling cursor reaches it and
closes it when the cursor moves on (paper A4-A6). While a window is open the `temporal` policy
admits every queued prompt; once it closes, the prompts routed during the window still run (they
were promised to it), and prompts that arrive later wait for the next window. A scheduler starts
with an uncommanded open window, so that a lone instance (no cluster above it) still prefills;
a cluster controller closes it before the first request. Only commanded windows are counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefillWindow:
    is_open: bool = True
    opened_at: float | None = None  # start of the current (or last) commanded window
    closed_at: float | None = None
    num_windows: int = 0  # commanded windows opened so far
    total_open_s: float = 0.0  # summed length of closed commanded windows
    longest_open_s: float = 0.0
    tokens_at_open: dict[str, int] = field(default_factory=dict)  # request id -> output tokens at the open
    carried: set[str] = field(default_factory=set)  # prompts queued when it closed: they may still run

    def open(self, now: float, running_tokens: dict[str, int]) -> bool:
        if self.is_open and self.opened_at is not None:
            return False
        self.is_open, self.opened_at, self.closed_at = True, now, None
        self.num_windows += 1
        self.tokens_at_open = running_tokens
        self.carried = set()
        return True

    def close(self, now: float, queued_ids) -> bool:
        if not self.is_open:
            return False
        self.is_open = False
        if self.opened_at is not None:
            self.closed_at = now
            self.total_open_s += now - self.opened_at
            self.longest_open_s = max(self.longest_open_s, now - self.opened_at)
        self.carried = set(queued_ids)
        return True

    def may_admit(self, request_id: str) -> bool:
        """May this queued prompt start now? (In the window, or routed into the one that just closed.)"""
        return self.is_open or request_id in self.carried

    def mean_open_s(self) -> float | None:
        n = self.num_windows - (1 if self.is_open and self.opened_at is not None else 0)
        return self.total_open_s / n if n > 0 else None
