"""Engine overhead of long outputs: R requests x 4,096 generated tokens on a tiny random Llama.

The model is tiny (hidden 64, 2 layers) so that what grows with output length (copying token
lists, logprobs and text each step; the stream consumer's slicing) is what the clock sees. Runs
against whichever ecoserve is on the path, old (cumulative outputs) or new (deltas), so two
checkouts can be compared side by side:

    PYTHONPATH=<checkout> OMP_NUM_THREADS=1 python scripts/bench_long_output.py --requests 1 16
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch


def make_model(path: Path, max_len: int) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ecoserve.bench.throughput import _word_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=max_len)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    _word_tokenizer(1000).save_pretrained(path)
    return str(path)


def params(num_tokens: int):
    from ecoserve.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=1, stop=["w1 w2 w3"])


def run_offline(engine, prompts, num_tokens: int) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"o{i}", {"prompt_token_ids": p}, params(num_tokens))
    done = 0
    while engine.has_unfinished_requests():
        done += sum(o.finished for o in engine.step())
    assert done == len(prompts)
    return time.perf_counter() - t0


async def run_streaming(engine, prompts, num_tokens: int) -> float:
    """Consume every stream the way the server's SSE loop does (deltas, or slices of cumulative outputs)."""
    from ecoserve.engine.async_engine import AsyncEngine

    ae = AsyncEngine(engine)
    ae.start()

    async def consume(i: int, p: list[int]) -> int:
        sent_chars = sent_tokens = chunks = 0
        async for out in ae.generate(f"s{i}", p, params(num_tokens)):
            c = out.outputs[0]
            if hasattr(c, "new_text"):
                text, tokens, lps = c.new_text, c.new_token_ids, c.new_logprobs
            else:
                text, tokens, lps = c.text[sent_chars:], c.token_ids[sent_tokens:], c.logprobs[sent_tokens:]
                sent_chars, sent_tokens = len(c.text), len(c.token_ids)
            chunks += bool(text or tokens or lps)
        return chunks

    t0 = time.perf_counter()
    await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - t0
    await ae.stop()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--output-len", type=int, default=4096)
    ap.add_argument("--model", default=None, help="reuse a model directory written by an earlier run")
    args = ap.parse_args()
    from ecoserve.config import EngineArgs
    from ecoserve.engine.llm_engine import LLMEngine

    max_len = args.output_len + 64
    model = args.model or make_model(Path(tempfile.mkdtemp()) / "tiny", max_len)
    for r in args.requests:
        engine = LLMEngine(EngineArgs(model, num_threads=1, max_model_len=max_len, max_num_seqs=max(r, 1),
                                      max_num_batched_tokens=max(2048, 16 * r)).create_engine_config())
        prompts = [[3 + (7 * i + j) % 900 for j in range(16)] for i in range(r)]
        run_offline(engine, prompts[:1], 64)  # warm-up
        offline = run_offline(engine, prompts, args.output_len)
        streaming = asyncio.run(run_streaming(engine, prompts, args.output_len))
        print(f"requests {r:3d} x {args.output_len} tokens: offline {offline:7.2f} s, streaming {streaming:7.2f} s")


if __name__ == "__main__":
    main()
