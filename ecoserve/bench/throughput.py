"""`ecoserve bench throughput`: offline throughput on a fixed random workload, optionally beside HF.

The default workload: 64 requests, prompt lengths uniform in [32, 512], output lengths uniform in
[32, 256], random token ids, greedy, ignore_eos, seed 0. `--dtypes` runs ours (and the peer) at several
precisions on the same requests, so one table holds e.g. ours bfloat16, ours float32 and vLLM at each.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ecoserve.bench.profile import Breakdown
from ecoserve.bench.roofline import Work, attention_flops_per_token, linear_flops_per_token
from ecoserve.config import DTYPES, EngineArgs

# A random Llama of about 125M parameters, the benchmark's reference model on CPU.
LLAMA_125M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048)
# A Qwen3-MoE of 0.52B parameters with 64 experts of 256 and 8 active per token (Qwen3-30B-A3B's 128 / 8 ratio
# of experts, and its 3/8 of hidden as expert size): each token computes what the 125M dense Qwen3 beside it
# computes (8 x 256 = 2048 intermediate), but the model holds 4x the weights.
QWEN3_125M = dict(LLAMA_125M, head_dim=64)
QWEN3_MOE_520M_A125M = dict(QWEN3_125M, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                            norm_topk_prob=True)
RANDOM_MODELS = ("llama-125m", "qwen3-125m", "qwen3-moe-520m-a125m")  # what --random-model can write


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

    def shifted(self, k: int, vocab: int) -> "Workload":
        """The same lengths with other token ids: the same work again, with no prefix-cache hits on this one."""
        span = vocab - 100
        return Workload([[100 + (t - 100 + 7919 * k) % span for t in p] for p in self.prompts], self.output_lens)


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
    dtype: str | None = None  # the precision the system ran in (ours resolved from --dtype)
    weights: str | None = None  # quantized weights (--quantization), None for float ones
    num_threads: int | None = None
    profile: Breakdown | None = field(default=None, repr=False)
    peer_profile: dict | None = field(default=None, repr=False)  # a peer's --profile: seconds by category, top ops

    @property
    def name(self) -> str:
        """The system and its quantized weights, if any (the table's first column)."""
        return f"{self.system} {self.weights}" if self.weights else self.system

    @property
    def label(self) -> str:
        return f"{self.name} {self.dtype}" if self.dtype else self.name

    def to_dict(self) -> dict:
        out = asdict(replace(self, profile=None))
        out["profile"] = self.profile.to_dict() if self.profile else None
        return out


def checkpoint_dtype(dtypes: list[str]) -> str:
    """The dtype the random checkpoint is stored in: the first 16-bit one the runs ask for, else float32.

    As with real checkpoints, a bfloat16 run then reads bfloat16 weights, with no conversion at load
    in either engine, and `auto` resolves alike in both (each takes the checkpoint's dtype where it
    runs it); float32 runs of the same command read the same values widened."""
    return next((d for d in dtypes if d in ("bfloat16", "float16")), "float32")


def _random_model_config(name: str):
    import transformers

    arch, kwargs = {"llama-125m": ("LlamaConfig", LLAMA_125M), "qwen3-125m": ("Qwen3Config", QWEN3_125M),
                    "qwen3-moe-520m-a125m": ("Qwen3MoeConfig", QWEN3_MOE_520M_A125M)}[name]
    return getattr(transformers, arch)(**kwargs)


def random_model_dir(name: str, dtype: str) -> Path:
    return Path(os.environ.get("ECOSERVE_BENCH_DIR", tempfile.gettempdir())) / (
        f"ecoserve-{name}-random" + ("" if dtype == "float32" else f"-{dtype}"))


def make_random_model(path: Path, name: str = "llama-125m", dtype: str = "float32") -> Path:
    """Write the random checkpoint `name` (RANDOM_MODELS) in `dtype` (the same seed: the bfloat16 weights are
    the float32 ones rounded), reusing one already there."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_random_model_config(name), dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    _word_tokenizer(model.config.vocab_size).save_pretrained(path)
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


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_ecoserve(model: str, wl: Workload, args: argparse.Namespace, setup: EngineSetup | None = None,
                 dtype: str | None = None, config: dict | None = None) -> Figures:
    """One timed `LLM.generate` of the workload; with --profile, two profiled passes of the same work after it."""
    import torch

    from ecoserve.engine.llm import LLM
    from ecoserve.model.loader import resolve_dtype
    from ecoserve.sampling import SamplingParams

    engine = EngineArgs.from_cli_args(args)
    setup = setup or EngineSetup(engine.tensor_parallel_size, engine.pipeline_parallel_size)
    engine = replace(engine, model=model, scheduling_policy=setup.policy or engine.scheduling_policy,
                     num_threads=setup.threads or engine.num_threads, tensor_parallel_size=setup.tp,
                     pipeline_parallel_size=setup.pp, dtype=dtype or engine.dtype)
    if args.profile and setup.tp * setup.pp > 1:
        raise SystemExit("--profile profiles a single-process engine; its ranks run in other processes under TP/PP")
    t0 = time.perf_counter()
    llm = LLM(**asdict(engine))
    try:
        startup = time.perf_counter() - t0
        core = llm.llm_engine
        spec = core.loaded.spec
        # a TP/PP engine's weights live in its ranks: resolve the dtype as they did
        resolved = _dtype_name(core.loaded.model.dtype if core.loaded.model is not None else
                               resolve_dtype(engine.dtype, engine.device, spec.torch_dtype))
        threads = engine.num_threads or torch.get_num_threads()
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]

        def run(work: Workload):
            return llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=not args.no_tqdm)

        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = run(wl)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == wl.num_output_tokens, (produced, wl.num_output_tokens)
        name = "ecoserve" if not args.configs else f"ecoserve {setup.name}"
        figures = _figures(name, wl, elapsed, startup)
        figures.dtype, figures.num_threads = resolved, threads
        figures.weights = engine.quantization if engine.quantization not in (None, "none") else None
        if args.profile:
            figures.profile = _profile(llm, run, wl, figures, config, spec.vocab_size)
    finally:
        llm.llm_engine.shutdown()
    figures.cpu_s = cpu if setup.tp * setup.pp == 1 else None  # the ranks' CPU is in other processes
    return figures


def _profile(llm, run, wl: Workload, figures: Figures, config: dict | None, vocab: int) -> Breakdown:
    """Profile the run's work again (other token ids: no prefix-cache hits), against the roofline."""
    from ecoserve.bench import roofline
    from ecoserve.bench.profile import profile_run

    if config is None:
        raise SystemExit("--profile needs the model's config.json (a model directory, or a GGUF's conversion)")
    core = llm.llm_engine
    passes = itertools.count(1)
    work = Work.of(config, [len(p) for p in wl.prompts], wl.output_lens, core.kv_bytes_per_token())
    breakdown, top = profile_run(lambda: run(wl.shifted(next(passes), vocab)), label=figures.label,
                                 elapsed_s=figures.elapsed_s, model=core.loaded.model, work=work,
                                 weight_bytes_per_step=roofline.weight_bytes_per_step(core.loaded.model),
                                 roofline=roofline.measure(figures.dtype, figures.num_threads))
    print(top)
    return breakdown


def run_hf(model: str, wl: Workload, args: argparse.Namespace, dtype: str) -> Figures:
    """transformers' batched generate: length-sorted batches, left padding, greedy, no EOS stop."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
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
    figures = _figures("hf-transformers", wl, time.perf_counter() - t0)
    figures.dtype, figures.num_threads = dtype, torch.get_num_threads()
    return figures


def vllm_dtype(args: argparse.Namespace, dtype: str) -> str:
    """The dtype vLLM runs against ours at `dtype`: the same, except under W8A8, whose CPU kernels take bfloat16
    (or float16) activations only."""
    return "bfloat16" if args.quantization == "w8a8" else dtype


def run_vllm(model: str, wl: Workload, args: argparse.Namespace, dtype: str, vocab: int) -> Figures:
    """vLLM's CPU build on the same requests, scheduler limits and dtype (a GGUF model: its cached HF conversion);
    with --profile, a profiled pass of the same work after it (ids shifted within `vocab`)."""
    from ecoserve.bench import peers
    from ecoserve.model.loader import resolve_model_path

    threads = args.num_threads or os.cpu_count() or 1
    try:
        path, weights = resolve_model_path(model), None
        if args.quantization == "w8a8":  # vLLM at the same precision: the same int8 weights through its W8A8 kernels
            path, weights = peers.vllm_w8a8_checkpoint(path), "w8a8"
        out = peers.vllm_generate(args.peer_python, path, wl.prompts, wl.output_lens, threads,
                                  args.max_num_batched_tokens, args.max_num_seqs, dtype,
                                  profile_vocab=vocab if args.profile else None)
    except peers.PeerUnavailable as e:
        raise SystemExit(f"--compare vllm: {e}") from None
    if out["output_tokens"] != wl.num_output_tokens:
        raise SystemExit(f"--compare vllm: vLLM produced {out['output_tokens']} tokens, not {wl.num_output_tokens}")
    figures = _figures("vllm-cpu", wl, out["elapsed_s"], out["startup_s"])
    figures.cpu_s, figures.dtype, figures.num_threads, figures.weights = out["cpu_s"], dtype, threads, weights
    if args.profile:
        from ecoserve.bench.profile import peer_breakdown

        figures.peer_profile, table = peer_breakdown(figures.label, figures.elapsed_s, out["op_seconds"])
        print(table)
    return figures


def _figures(system: str, wl: Workload, elapsed: float, startup: float | None = None) -> Figures:
    n = len(wl.prompts)
    return Figures(system, elapsed, n / elapsed, wl.num_output_tokens / elapsed,
                   (wl.num_output_tokens + wl.num_prompt_tokens) / elapsed, startup)


Run = tuple[EngineSetup | None, str | None]  # a setup of --configs (None: the flags') and a dtype (None: --dtype)


def compare_runs(model: str, wl: Workload, args: argparse.Namespace, runs: list[Run],
                 config: dict | None = None) -> list[Figures]:
    """Each run `args.repeat` times, interleaved (a shared machine's load hits all alike); medians of time."""
    done: dict[Run, list[Figures]] = {r: [] for r in runs}
    for k in range(args.repeat):
        for r in runs:
            done[r].append(run_ecoserve(model, wl, args, *r, config=config))
            if len(runs) > 1 or args.repeat > 1:
                print(f"round {k + 1}: {done[r][-1].label} {done[r][-1].elapsed_s:.1f} s", flush=True)
    return [sorted(fs, key=lambda f: f.elapsed_s)[len(fs) // 2] for fs in done.values()]


def ratios(results: list[Figures]) -> dict[str, float]:
    """Output throughput ratios: ours against each peer at the same dtype, or with the same quantized weights
    (also per CPU second), ours at
    the first dtype against ours at each other (bfloat16 / float32 for `--dtypes bfloat16 float32`), and
    each --configs setup against the first at its dtype."""
    ours = [r for r in results if r.system.startswith("ecoserve")]
    peers = [r for r in results if not r.system.startswith("ecoserve")]
    out: dict[str, float] = {}
    for r in ours:
        # a peer with quantized weights against ours with the same ones, a float peer against ours at its dtype
        for p in (p for p in peers if (p.weights == r.weights if p.weights else p.dtype == r.dtype)):
            out[f"{r.label} / {p.label} output throughput"] = r.output_tokens_per_s / p.output_tokens_per_s
            if r.cpu_s and p.cpu_s:
                out[f"{r.label} / {p.label} output tokens per CPU second"] = p.cpu_s / r.cpu_s
    first_dtype = ours[0].dtype
    for r in ours:
        first = next(b for b in ours if b.system == r.system and b.dtype == first_dtype)
        if r.dtype != first_dtype:
            out[f"{first.label} / {r.label} output throughput"] = first.output_tokens_per_s / r.output_tokens_per_s
        base = next(b for b in ours if b.dtype == r.dtype)
        if r.system != base.system:
            out[f"{r.label} / {base.label} output throughput"] = r.output_tokens_per_s / base.output_tokens_per_s
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput on a fixed random workload")
    p.add_argument("--model", default=None, help="model dir / hub id / .gguf; default: --random-model")
    p.add_argument("--random-model", nargs="+", default=["llama-125m"], choices=RANDOM_MODELS,
                   help="without --model: the random checkpoints to write (once, under $ECOSERVE_BENCH_DIR or the temp "
                        "dir) and run, one after another on the same requests: a 125M Llama, a 125M Qwen3, or a "
                        "Qwen3-MoE of 0.52B with 0.125B active; several: also each system's throughput on the first "
                        "against the others")
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
    p.add_argument("--dtypes", nargs="+", default=None, metavar="DTYPE",
                   choices=DTYPES,
                   help="run ours (each --configs setup) and the --compare peer at each of these dtypes on the same "
                        "requests, instead of --dtype; e.g. bfloat16 float32: ratios per dtype, and the first "
                        "against the others")
    p.add_argument("--repeat", type=int, default=1, help="rounds of our runs; the median time of each is reported")
    p.add_argument("--profile", action="store_true",
                   help="after each of our runs, profile the same work again: where the time goes (GEMM, attention, "
                        "elementwise, sampling, Python) and the GEMM FLOP/s and streamed bytes against a GEMM peak "
                        "and a copy bandwidth measured in the same process, dtype and threads")
    p.add_argument("--compare", choices=["hf", "vllm"], default=None,
                   help="also run HF transformers, or vLLM's CPU build (in --peer-python), on the same requests at "
                        "the dtype each of our runs resolved")
    p.add_argument("--peer-python", default=sys.executable, help="the interpreter that has vLLM (its own venv)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--json", default=None, help="write the figures to this path")
    p.add_argument("--no-tqdm", action="store_true")
    p.set_defaults(func=main)


def _model_config(model: str) -> dict | None:
    """The HF config of `model` (a GGUF: its cached conversion's), or None when there is none to read."""
    from ecoserve.model.loader import resolve_model_path

    path = resolve_model_path(model) / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def main(args: argparse.Namespace) -> int:
    dtypes = args.dtypes or [args.dtype]
    stored = checkpoint_dtype(dtypes)
    names = [None] if args.model else list(dict.fromkeys(args.random_model))
    reports = []
    for name in names:
        model = args.model or str(make_random_model(random_model_dir(name, stored), name, stored))
        if len(names) > 1:
            print(f"\n== {name}", flush=True)
        reports.append(run_model(model, args, dtypes))
    report = reports[0]
    if len(reports) > 1:
        report = {"models": dict(zip(names, reports)), "ratios": model_ratios(names, reports)}
        for key, value in report["ratios"].items():
            print(f"{key}: {value:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def model_ratios(names: list[str], reports: list[dict]) -> dict[str, float]:
    """Each system's output throughput on the first model against the same system and dtype on each other."""
    out = {}
    first = {(r["system"], r["dtype"]): r for r in reports[0]["results"]}
    for name, report in zip(names[1:], reports[1:]):
        for r in report["results"]:
            base = first.get((r["system"], r["dtype"]))
            if base:
                out[f"{r['system']} {r['dtype']}: {names[0]} / {name} output throughput"] = \
                    base["output_tokens_per_s"] / r["output_tokens_per_s"]
    return out


def run_model(model: str, args: argparse.Namespace, dtypes: list[str]) -> dict:
    """Every run of the command on one model: prints its table, returns its JSON report."""
    import torch

    from ecoserve.bench import roofline
    from ecoserve.bench.profile import side_by_side

    config = _model_config(model)
    # the workload's ids come from a directory's vocabulary; a GGUF or hub model keeps the historical 32000
    vocab = config["vocab_size"] if config and Path(model).is_dir() else 32000
    wl = make_workload(args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range), vocab, args.seed)
    setups = [EngineSetup.parse(c) for c in args.configs] if args.configs else [None]
    results = compare_runs(model, wl, args, [(s, d) for d in dtypes for s in setups], config)
    ours = dict.fromkeys(r.dtype for r in results)  # each resolved dtype once, in order
    if args.compare == "hf":
        results += [run_hf(model, wl, args, dtype) for dtype in ours]
    elif args.compare == "vllm":
        peer_dtypes = dict.fromkeys(vllm_dtype(args, d) for d in ours)
        results += [run_vllm(model, wl, args, dtype, vocab) for dtype in peer_dtypes]
    ceilings = {(r.dtype, r.num_threads): roofline.measure(r.dtype, r.num_threads or torch.get_num_threads())
                for r in results}
    if config:
        mean_ctx = sum(len(p) + o / 2 for p, o in zip(wl.prompts, wl.output_lens)) / len(wl.prompts)
        # matmul FLOPs: linears and attention of every computed token, the LM head of every sampled one
        per_token = linear_flops_per_token(config) + attention_flops_per_token(config, mean_ctx / 2)
        total = (wl.num_prompt_tokens + wl.num_output_tokens) * per_token \
            + wl.num_output_tokens * 2 * config["hidden_size"] * config["vocab_size"]
        for r in results:
            r.achieved_gflops = total / r.elapsed_s / 1e9
    print(f"\nworkload: {len(wl.prompts)} requests, {wl.num_prompt_tokens} prompt + {wl.num_output_tokens} output "
          "tokens")
    for c in ceilings.values():
        print(f"{c.dtype} at {c.num_threads} thread(s): packed-GEMM peak {c.gemm_peak_gflops:.1f} GFLOP/s "
              f"({'x'.join(map(str, roofline.PEAK_SHAPE))}), copy bandwidth {c.memory_gbps:.1f} GB/s")
    width = max(24, *(len(r.name) + 2 for r in results))
    print(f"{'system':<{width}}{'dtype':<10}{'time s':>9}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}"
          f"{'GFLOP/s':>10}{'% peak':>8}")
    for r in results:
        gf = r.achieved_gflops or 0.0
        peak = ceilings[r.dtype, r.num_threads].gemm_peak_gflops
        print(f"{r.name:<{width}}{r.dtype:<10}{r.elapsed_s:>9.1f}{r.requests_per_s:>9.3f}{r.output_tokens_per_s:>11.1f}"
              f"{r.total_tokens_per_s:>13.1f}{gf:>10.1f}{100 * gf / peak:>7.0f}%")
    for r in results:
        if r.cpu_s is not None:
            print(f"{r.label} process CPU: {r.cpu_s:.1f} s ({wl.num_output_tokens / r.cpu_s:.1f} output tokens per "
                  f"CPU second)")
    found = ratios(results)
    for key, value in found.items():
        print(f"{key}: {value:.2f}x")
    if results[0].startup_s is not None:
        print(f"ecoserve engine start-up (load + KV allocation): {results[0].startup_s:.2f} s")
    profiles = [r.profile for r in results if r.profile is not None]
    if profiles:
        print("\n" + side_by_side(profiles))
    return {"model": model, "workload": {"requests": len(wl.prompts), "prompt_tokens": wl.num_prompt_tokens,
                                         "output_tokens": wl.num_output_tokens},
            "roofline": [asdict(c) for c in ceilings.values()], "results": [r.to_dict() for r in results],
            "ratios": found}
