"""Offline multi-LoRA benchmark: throughput with 1, 4 and 16 adapters at two ranks against no LoRA on the same
engine, and the cold-start TTFT of a request whose adapter is on disk, with and without layer-wise loading.

    python -m ecoserve.bench.lora --num-threads 2 --json results/lora.json

One engine (`enable_lora`, `max_loras` = the most adapters asked for, `max_lora_rank` = the highest rank) runs
every configuration on the same workload's lengths (other token ids each time, so no prefix-cache hits);
requests take the adapters round-robin. Adapters are random PEFT checkpoints for every projection (q, k, v,
o, gate, up, down) written once into a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ecoserve.bench.throughput import Workload, make_workload
from ecoserve.request import LoRARequest


@dataclass
class ThroughputRow:
    adapters: int
    rank: int | None
    elapsed_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


@dataclass
class ColdStartRow:
    mode: str
    ttft_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ttft_ms)


def write_adapter(path: Path, targets, rank: int, seed: int, dtype) -> Path:
    """A random PEFT LoRA checkpoint (all seven projections) for the engine's model, as peft saves one."""
    import torch
    from safetensors.torch import save_file

    from ecoserve.lora.checkpoint import PROJECTION_TO_FUSED

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(targets.num_layers):
        for proj, (fused, _) in PROJECTION_TO_FUSED.items():
            fan_in, fan_out = targets.projection_shape(proj)
            part = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTION_TO_FUSED),
              "bias": "none", "use_rslora": False}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def run_throughput(llm, workload: Workload, loras: list[LoRARequest | None]) -> float:
    from ecoserve import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False,
                 lora_request=[loras[i % len(loras)] for i in range(len(workload.prompts))])
    return time.perf_counter() - started


def cold_start(llm, path: Path, prompt: list[int], layerwise: bool, trials: int, first_id: int) -> list[float]:
    """TTFT (ms) of one request whose adapter is registered on arrival and read from disk (a new id each trial,
    so nothing of it is in host memory or a slot)."""
    from ecoserve import SamplingParams

    engine = llm.llm_engine
    engine.lora.layerwise = layerwise
    times = []
    for t in range(trials):
        lora = LoRARequest(f"cold-{first_id + t}", first_id + t, str(path))
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                     lora_request=lora)
        times.append((time.perf_counter() - started) * 1e3)
        engine.remove_lora(lora.lora_name)
    engine.lora.layerwise = True
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ecoserve.bench.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--cold-trials", type=int, default=5)
    parser.add_argument("--cold-prompt-len", type=int, default=128)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)

    from ecoserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, enable_lora=True,
              max_loras=max(args.adapters), max_cpu_loras=max(args.adapters) * len(args.ranks),
              max_lora_rank=max(args.ranks))
    engine = llm.llm_engine
    targets = engine.lora.targets
    vocab = engine.loaded.spec.vocab_size
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab)
    tmp = Path(tempfile.mkdtemp(prefix="ecoserve-lora-bench-"))
    adapters: dict[int, list[LoRARequest]] = {}
    next_id = 1
    for rank in args.ranks:
        adapters[rank] = []
        for i in range(max(args.adapters)):
            path = write_adapter(tmp / f"r{rank}-{i}", targets, rank, seed=next_id, dtype=engine.model_dtype)
            lora = LoRARequest(f"r{rank}-{i}", next_id, str(path))
            engine.add_lora(lora)  # in host memory: the throughput runs measure compute, not disk
            adapters[rank].append(lora)
            next_id += 1

    run_throughput(llm, make_workload(8, (16, 64), (8, 16), vocab, seed=1), [None, *adapters[args.ranks[0]][:2]])
    configs: list[tuple[int, int | None]] = [(0, None)] + [(n, r) for r in args.ranks for n in args.adapters]
    rows = []
    total_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    for k, (n, rank) in enumerate(configs):
        loras = [None] if rank is None else adapters[rank][:n]
        elapsed = run_throughput(llm, workload.shifted(k + 1, vocab), loras)
        rows.append(ThroughputRow(n, rank, elapsed, workload.num_output_tokens / elapsed, total_tokens / elapsed))
        print(f"  {n} adapters, rank {rank}: {elapsed:.2f} s", file=sys.stderr, flush=True)

    prompt = make_workload(1, (args.cold_prompt_len, args.cold_prompt_len), (1, 1), vocab, seed=2).prompts[0]
    cold_path = adapters[max(args.ranks)][0].lora_path
    cold_start(llm, cold_path, prompt, True, 1, 10_000)  # warm the path once
    cold = [ColdStartRow("layer-wise", cold_start(llm, cold_path, prompt, True, args.cold_trials, 20_000)),
            ColdStartRow("whole adapter first", cold_start(llm, cold_path, prompt, False, args.cold_trials, 30_000))]
    warm_lora = adapters[max(args.ranks)][0]
    warm = []
    for t in range(args.cold_trials + 1):  # the first call brings it back into a slot: not timed
        prompt = [100 + (x + 1) % (vocab - 100) for x in prompt]  # no prefix-cache hit
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                     lora_request=warm_lora)
        if t:
            warm.append((time.perf_counter() - started) * 1e3)
    cold.append(ColdStartRow("adapter resident (reference)", warm))

    base = rows[0].output_tokens_per_s
    print(f"\nworkload: {args.num_requests} requests, prompt {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens ({workload.num_prompt_tokens} + "
          f"{workload.num_output_tokens}); model {engine.model_name}, {engine.model_dtype}, threads "
          f"{args.num_threads or 'default'}")
    print("| adapters | rank | time (s) | output tok/s | total tok/s | vs no LoRA |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.adapters or 'none'} | {row.rank or '-'} | {row.elapsed_s:.2f} | {row.output_tokens_per_s:.1f} | "
              f"{row.total_tokens_per_s:.1f} | {row.output_tokens_per_s / base:.3f} |")
    print(f"\ncold start, rank-{max(args.ranks)} adapter, {args.cold_prompt_len}-token prompt, 1 output token "
          f"(TTFT ms, {args.cold_trials} trials)")
    print("| loading | median | all |")
    print("|---|---|---|")
    for c in cold:
        print(f"| {c.mode} | {c.median_ms:.1f} | {', '.join(f'{t:.1f}' for t in c.ttft_ms)} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "model": engine.model_name, "dtype": str(engine.model_dtype),
            "prompt_tokens": workload.num_prompt_tokens, "output_tokens": workload.num_output_tokens,
            "throughput": [asdict(r) | {"vs_no_lora": r.output_tokens_per_s / base} for r in rows],
            "cold_start": [asdict(c) | {"median_ms": c.median_ms} for c in cold]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
