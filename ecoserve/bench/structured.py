"""`ecoserve bench structured`: time per output token with a JSON-schema constraint vs without.

The two run on one engine, interleaved and repeated (the median is reported), so a shared machine
slows both alike. The schema is long enough that no output completes it within --output-len
tokens: every request, constrained or not, decodes exactly --output-len tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from ecoserve.config import EngineArgs

# At least 64 short strings: never complete within the measured tokens.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 64}},
    "required": ["title", "notes"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "Write a JSON object with a title and a list of 64 short notes about cats."}]


def measure(llm, batch: int, output_len: int, constrained: bool) -> float:
    """Mean over the batch of the request's time per output token after the first (ms)."""
    from ecoserve.sampling import SamplingParams
    from ecoserve.structured import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None)
    prompt = {"prompt_token_ids": llm.encode_chat(PROMPT)}
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    tpots = []
    for out in outs:
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        if n != output_len:
            raise RuntimeError(f"a request produced {n} tokens, not {output_len}: the comparison would be unfair")
        tpots.append(1000 * (m.last_token_time - m.first_token_time) / (n - 1))
    return statistics.fmean(tpots)


def run(engine: EngineArgs, batches: list[int], output_len: int, repeats: int) -> list[dict]:
    from ecoserve.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(dataclasses.replace(engine, max_num_seqs=max(batches))))
    measure(llm, 1, 4, constrained=True)  # warm-up: tokenizer for the grammar engine, grammar compiled
    rows = []
    for batch in batches:
        plain, guided = [], []
        for _ in range(repeats):  # interleaved, so load changes hit both
            plain.append(measure(llm, batch, output_len, constrained=False))
            guided.append(measure(llm, batch, output_len, constrained=True))
        p, g = statistics.median(plain), statistics.median(guided)
        rows.append({"batch": batch, "tpot_ms_plain": p, "tpot_ms_json_schema": g, "slowdown": g / p - 1,
                     "runs_plain": plain, "runs_json_schema": guided})
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured", help="TPOT with a JSON-schema constraint vs without")
    EngineArgs.add_cli_args(p, skip=("max_num_seqs",))  # the largest --batch
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main, num_threads=1)


def main(args: argparse.Namespace) -> int:
    rows = run(EngineArgs.from_cli_args(args), args.batch, args.output_len, args.repeats)
    print("| batch | TPOT plain (ms) | TPOT JSON schema (ms) | slowdown |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['tpot_ms_plain']:.1f} | {r['tpot_ms_json_schema']:.1f} | "
              f"{100 * r['slowdown']:+.1f}% |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
