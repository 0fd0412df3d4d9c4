"""Batch-1 decode with and without speculative decoding on the embedded SmolLM2, beside llama.cpp with and without
its prompt-lookup decoding: one run, systems in turn, a table, ratios and JSON.

Workloads (chat prompts, greedy, `--output-len` tokens with EOS ignored as the llama.cpp peer bans it):
`edit` asks to rewrite a given text (its output repeats the text: prompt lookup's case), `chat` asks for a
story (free text). Systems: the float model (the GGUF's weights dequantized) without speculation, with n-gram
proposals (fixed k and "auto"), and with the GGUF itself as its draft (the self-draft); the GGUF model
(`--quantization gguf`) without and with n-gram proposals; llama.cpp on the same file without and with
`LlamaPromptLookupDecoding`. Greedy outputs of one set of weights must match with and without speculation.

    python scripts/bench_spec_decode.py --num-threads 2 --peer-python /work/peers/llamacpp-noamx/bin/python \\
        --json results/spec_decode/bench.json
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

TEXT = ("The library opens at nine in the morning and closes at six in the evening on weekdays. On Saturdays it "
        "opens at ten and closes at four. It is closed on Sundays and public holidays. Members may borrow up to five "
        "books at a time for three weeks. Books can be renewed twice, online or at the front desk, unless another "
        "member has reserved them. Late returns cost twenty cents per book per day. The reading room on the second "
        "floor is for quiet study only; group work is welcome in the meeting rooms on the ground floor, which can be "
        "booked for up to two hours a day. Printing costs ten cents a page in black and white and fifty cents in "
        "colour.")
WORKLOADS = {
    "edit": f"Rewrite the following text, replacing every occurrence of 'books' with 'items' and changing nothing "
            f"else:\n\n{TEXT}",
    "chat": "Write a short story about a robot who learns to paint.",
}


def systems(args) -> list[tuple[str, str, dict]]:
    """(name, the weights it runs: float | gguf, engine options)."""
    from ecoserve.model.loader import gguf_file

    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
             "prompt_lookup_max": args.lookup_max}
    auto = {**ngram, "num_speculative_tokens": "auto"}
    draft = {"method": "draft_model", "model": str(gguf_file(None)), "quantization": "gguf",
             "num_speculative_tokens": args.draft_k}
    gguf = {"quantization": "gguf"}
    return [("float", "float", {}), ("float ngram", "float", {"speculative_config": ngram}),
            ("float auto", "float", {"speculative_config": auto}),
            ("float self-draft", "float", {"speculative_config": draft}),
            ("gguf", "gguf", gguf), ("gguf ngram", "gguf", {**gguf, "speculative_config": ngram}),
            ("gguf auto", "gguf", {**gguf, "speculative_config": auto})]


def run_ours(name: str, options: dict, prompts: dict[str, list[int]], args) -> dict[str, dict]:
    """Each workload once on one engine (after a short warm-up): figures, tokens, acceptance and the tuner's k."""
    from ecoserve.bench.latency import decode_figures
    from ecoserve.engine.llm import LLM
    from ecoserve.sampling import SamplingParams

    try:
        llm = LLM(num_threads=args.num_threads, **options)
    except Exception as e:  # a system this build cannot run is reported, not hidden
        return {w: {"error": f"{type(e).__name__}: {e}"} for w in prompts}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts["chat"]}], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)
    spec = llm.llm_engine.speculator
    out: dict[str, dict] = {}
    for workload, ids in prompts.items():
        before = _spec_state(spec)
        t0, cpu0 = time.perf_counter(), time.process_time()
        result = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        figures = decode_figures(result, time.perf_counter() - t0, time.process_time() - cpu0)
        figures["token_ids"] = list(result.outputs[0].token_ids)
        figures.update(_spec_delta(before, _spec_state(spec)))
        out[workload] = figures
    del llm
    gc.collect()
    return out


def _spec_state(spec) -> dict | None:
    if spec is None:
        return None
    c = spec.counters
    tuner = getattr(spec.length, "tuner", None)
    return {"drafts": c.num_drafts, "draft_tokens": c.num_draft_tokens, "accepted": c.num_accepted_tokens,
            "chosen": dict(tuner.stats.chosen) if tuner is not None else None}


def _spec_delta(before: dict | None, after: dict | None) -> dict:
    """This run's acceptance length (tokens per verifying step) and, for auto, how often the tuner chose each k."""
    if after is None:
        return {}
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    out = {"num_drafts": drafts, "num_draft_tokens": after["draft_tokens"] - before["draft_tokens"],
           "num_accepted_tokens": accepted, "acceptance_length": 1 + accepted / drafts if drafts else 1.0}
    if after["chosen"] is not None:
        out["tuner_k"] = {k: n - before["chosen"].get(k, 0) for k, n in sorted(after["chosen"].items())
                          if n - before["chosen"].get(k, 0)}
    return out


def run_peer(lookup: int, prompts: dict[str, list[int]], args) -> dict[str, dict]:
    from ecoserve.bench import peers
    from ecoserve.model.loader import gguf_file

    out = {}
    for workload, ids in prompts.items():
        try:
            out[workload] = peers.llama_cpp_decode(args.peer_python, gguf_file(None), ids, args.output_len,
                                                   args.num_threads, prompt_lookup=lookup)
        except peers.PeerUnavailable as e:
            out[workload] = {"error": str(e)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=5, help="n-gram proposals per step (default %(default)s)")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--draft-k", type=int, default=3, help="self-draft proposals per step (default %(default)s)")
    p.add_argument("--peer-lookup", type=int, default=10,
                   help="LlamaPromptLookupDecoding's num_pred_tokens (its default, %(default)s)")
    p.add_argument("--peer-python", default=None, help="the interpreter with llama-cpp-python (none: no peer)")
    p.add_argument("--systems", default=None, help="comma-separated names to run (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the systems in turn")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from ecoserve.engine.llm import LLM

    tokenizer_llm = LLM(num_threads=1, quantization="gguf")
    prompts = {w: tokenizer_llm.encode_chat([{"role": "user", "content": text}]) for w, text in WORKLOADS.items()}
    del tokenizer_llm
    chosen = set(args.systems.split(",")) if args.systems else None
    ours = [s for s in systems(args) if chosen is None or s[0] in chosen]
    peers_ = [] if not args.peer_python else [(n, k) for n, k in (("llama.cpp", 0), ("llama.cpp lookup",
                                                                                      args.peer_lookup))
                                              if chosen is None or n in chosen]
    rounds: list[dict[str, dict]] = []
    for r in range(args.repeats):
        rows: dict[str, dict] = {}
        for name, _, options in ours:
            rows[name] = run_ours(name, options, prompts, args)
            _print(name, rows[name])
        for name, lookup in peers_:
            rows[name] = run_peer(lookup, prompts, args)
            _print(name, rows[name])
        _check_lossless(rows, {name: weights for name, weights, _ in ours})
        _print_ratios(rows)
        rounds.append(rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"output_len": args.output_len, "num_threads": args.num_threads,
                                               "k": args.k, "lookup": [args.lookup_min, args.lookup_max],
                                               "draft_k": args.draft_k, "peer_lookup": args.peer_lookup,
                                               "prompt_tokens": {w: len(i) for w, i in prompts.items()},
                                               "rounds": rounds}, indent=1))
    return 0


def _print(name: str, row: dict[str, dict]) -> None:
    for workload, f in row.items():
        if "error" in f:
            print(f"{name:<18} {workload:<5} unavailable: {f['error']}")
            continue
        extra = ""
        if "acceptance_length" in f:
            extra = f", acceptance length {f['acceptance_length']:.2f} over {f['num_drafts']} drafts"
        if f.get("tuner_k"):
            extra += f", tuner k {f['tuner_k']}"
        print(f"{name:<18} {workload:<5} decode {f['decode_tokens_per_s']:6.1f} tok/s, TPOT {f['tpot_ms']:6.2f} ms, "
              f"{f['cpu_ms_per_token']:5.1f} ms CPU/token{extra}", flush=True)


def _check_lossless(rows: dict[str, dict], weights: dict[str, str]) -> None:
    """Greedy tokens with speculation must equal those of the same weights without it."""
    for name, row in rows.items():
        base = weights.get(name)
        if base is None or name == base or base not in rows:
            continue
        for workload, f in row.items():
            ref = rows[base].get(workload, {})
            if "token_ids" in f and "token_ids" in ref and f["token_ids"] != ref["token_ids"]:
                print(f"MISMATCH: {name} {workload} differs from {base} without speculation")


def _print_ratios(rows: dict[str, dict]) -> None:
    def ratio(a: str, b: str, workload: str) -> str:
        fa, fb = rows.get(a, {}).get(workload, {}), rows.get(b, {}).get(workload, {})
        if "decode_tokens_per_s" not in fa or "decode_tokens_per_s" not in fb:
            return "n/a"
        return f"x{fa['decode_tokens_per_s'] / fb['decode_tokens_per_s']:.2f}"

    for a, b, workload, target in (("float ngram", "float", "edit", ">= 1.5"), ("float ngram", "float", "chat", ">= 0.95"),
                                   ("float auto", "float", "edit", ""), ("float auto", "float", "chat", ">= 0.95"),
                                   ("float self-draft", "float", "edit", "> 1"), ("float self-draft", "float", "chat", "> 1"),
                                   ("gguf ngram", "gguf", "edit", ""), ("gguf ngram", "gguf", "chat", ""),
                                   ("gguf auto", "gguf", "chat", ""),
                                   ("gguf ngram", "llama.cpp lookup", "edit", "> 1"),
                                   ("gguf auto", "llama.cpp lookup", "edit", "> 1"),
                                   ("gguf ngram", "llama.cpp lookup", "chat", ""),
                                   ("llama.cpp lookup", "llama.cpp", "edit", "")):
        print(f"{a} / {b} ({workload}): decode tok/s {ratio(a, b, workload)}" + (f"  (target {target})" if target else ""))


if __name__ == "__main__":
    sys.exit(main())
