"""The metric families a Grafana dashboard queries, and the families a /metrics scrape exposes,
so tests can check that every panel of a dashboard has data behind it."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

from prometheus_client.parser import text_string_to_metric_families

# A series name with a `prefix:` (PromQL recording-rule style); words without a colon are functions,
# keywords (by, sum, rate) or label names, never ours.
_SERIES = re.compile(r"(?<![\w:\"'])([a-zA-Z_]\w*:[a-zA-Z_:][\w:]*)")
_LABELS = re.compile(r"\{[^}]*\}")
_STRINGS = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'")
_RANGES = re.compile(r"\[[^\]]*\]")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def family(name: str) -> str:
    """The family a sample name belongs to: `x_bucket`, `x_sum`, `x_count`, `x_total` -> `x`."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _exprs(node: Any) -> Iterator[str]:
    """Every `targets[].expr` in a dashboard, panels nested in rows included."""
    if isinstance(node, dict):
        for target in node.get("targets") or []:
            if isinstance(target, dict) and isinstance(target.get("expr"), str):
                yield target["expr"]
        for key, value in node.items():
            if key != "targets":
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def expr_series(expr: str) -> set[str]:
    """Family names (prefix included) a PromQL expression reads; label matchers, strings and ranges stripped."""
    expr = _RANGES.sub(" ", _LABELS.sub(" ", _STRINGS.sub('""', expr)))
    return {family(m) for m in _SERIES.findall(expr)}


def dashboard_series(path: str | Path) -> set[str]:
    """Family names (prefix included) that the PromQL of every panel of the dashboard JSON at `path` reads."""
    dashboard = json.loads(Path(path).read_text())
    names: set[str] = set()
    for expr in _exprs(dashboard):
        names |= expr_series(expr)
    return names


def _scraped_name(f) -> str:
    """A counter's family without `_total`; other types keep their name (a histogram may end in `_total`)."""
    return family(f.name) if f.type == "counter" else f.name


def scraped_families(text: str) -> set[str]:
    """Family names in a Prometheus text exposition (counters without their `_total`)."""
    return {_scraped_name(f) for f in text_string_to_metric_families(text)}


def scraped_labels(text: str) -> dict[str, set[str]]:
    """Family name -> the label names its samples carry (`le` and `quantile` left out)."""
    labels: dict[str, set[str]] = {}
    for f in text_string_to_metric_families(text):
        names = labels.setdefault(_scraped_name(f), set())
        for sample in f.samples:
            names |= set(sample.labels) - {"le", "quantile"}
    return labels
