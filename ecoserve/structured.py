"""The structured-output request of one sequence: plain data only (no compiled grammar).

It travels inside SamplingParams, so it must stay serializable (strings, lists, dicts, bools):
a cluster frontend sends it to an instance process, and the instance's engine compiles it and
holds the matcher. Field names are vLLM's (`StructuredOutputsParams`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: a JSON schema, a regex, a list of choices, an EBNF/Lark grammar, or any JSON object."""

    json: str | dict[str, Any] | None = None  # a JSON schema (object or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF/EBNF (llama.cpp style)
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a schema object or its JSON text, "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical text of the spec: equal specs share one compiled grammar."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))
