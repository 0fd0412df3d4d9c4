"""`ecoserve simulate ...`: run a named experiment or one simulated serving run."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    import ecoserve.sim.tdpipe_experiment  # noqa: F401  (registers the "tdpipe" experiment)
    import ecoserve.sim.moe_experiment  # noqa: F401  (registers the "moe_offload" experiment)
    from ecoserve.sim.moe import PLACEMENTS
    from ecoserve.cluster.router import ROUTER_MODES
    from ecoserve.sim.experiments import EXPERIMENTS
    from ecoserve.sim.lora_experiment import ADAPTER_COUNTS
    from ecoserve.sim.hardware import GPUS, LINKS
    from ecoserve.sim.models import MODELS
    from ecoserve.sim.cluster import STRATEGIES
    from ecoserve.sim.workload import ARRIVALS, DATASETS

    p = subparsers.add_parser("simulate", help="simulate a GPU cluster serving with the live scheduling code")
    p.add_argument("experiment", nargs="?", default="run", choices=["run", "lora", *EXPERIMENTS.names()],
                   help="a named experiment, 'lora' (the most LoRA adapters served within the SLOs at --rate), or "
                        "'run' for one simulation")
    p.add_argument("--out", default="results/sim", help="folder for JSON and PNG (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--strategy", default="ecoserve", choices=STRATEGIES.names())
    p.add_argument("--model", default="codellama-34b", help=f"one of {', '.join(MODELS.names())} or a config.json path")
    p.add_argument("--gpu", default="L20", choices=GPUS.names(), type=str.lower)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--num-instances", type=int, default=8)
    p.add_argument("--network", default="10gbe", choices=LINKS.names())
    p.add_argument("--profile", default=None, help="tokens,ms CSV to use instead of the roofline")
    p.add_argument("--profile-tokens", default=None,
                   help="prompt lengths the router's start-up profile is timed at, as `ecoserve instance "
                        "--profile-tokens` (default: the same as there)")
    p.add_argument("--dataset", default="sharegpt", choices=DATASETS.names())
    p.add_argument("--trace", default=None, help="CSV/JSONL trace (arrival_time,input_len,output_len)")
    p.add_argument("--rate", type=float, default=8.0, help="request rate (req/s)")
    p.add_argument("--arrival", default="poisson", choices=ARRIVALS.names())
    p.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    p.add_argument("--ttft-slo", type=float, default=None)
    p.add_argument("--tpot-slo", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-mode", default="paper", choices=ROUTER_MODES.names(),
                   help="ecoserve: the macro-instance router (paper: our reading of Algorithm 1; paper-strict: "
                        "Algorithm 1 as printed; reference: the authors' released scheduler; fixed_interval: "
                        "ablation); default %(default)s")
    p.add_argument("--output-hold", default=None, choices=["on", "off"],
                   help="ecoserve: hold the prefill instance's output (default: on in reference mode only)")
    p.add_argument("--duration", type=float, default=None,
                   help="experiments: seconds of arrivals per rate point (default 45)")
    p.add_argument("--grid-ratio", type=float, default=None,
                   help="experiments: ratio between neighbouring rates of a goodput curve (default 1.2)")
    p.add_argument("--strategies", default=None,
                   help="experiments: comma-separated series (vllm, sarathi, distserve, mooncake, ecoserve "
                        "[paper mode], ecoserve_ref [reference mode], ecoserve_strict [paper-strict mode]); "
                        "speed: strategies")
    p.add_argument("--mitosis-step", type=float, default=None, help="mitosis: seconds per rate step (default 120)")
    p.add_argument("--models", default=None, help="experiments: comma-separated models (default: the paper's)")
    p.add_argument("--datasets", default=None, help="experiments: comma-separated datasets")
    p.add_argument("--num-speculative-tokens", default=None, metavar="K",
                   help="run: speculative decoding on every instance, K proposals per decode or auto (the tuner "
                        "over the instance's performance model); default: none")
    p.add_argument("--spec-acceptance-rate", type=float, default=0.7,
                   help="run: the chance a proposal is accepted given the ones before it were (default %(default)s)")
    p.add_argument("--spec-draft-cost", type=float, default=0.0,
                   help="run: one draft pass as a fraction of the target's decode step (0: n-gram lookup; about "
                        "0.3 for a Q4 self-draft); default %(default)s")
    p.add_argument("--num-adapters", type=int, default=None,
                   help="run: requests spread over this many LoRA adapters (default: no LoRA); lora: the largest "
                        f"count tried (default: {ADAPTER_COUNTS[-1]}, on the grid {','.join(map(str, ADAPTER_COUNTS))})")
    p.add_argument("--lora-rank", type=int, default=8, help="the adapters' rank (default: %(default)s)")
    p.add_argument("--max-loras", type=int, default=4,
                   help="adapters an instance holds on the device at once (default: %(default)s)")
    p.add_argument("--lora-zipf", type=float, default=0.0,
                   help="adapter popularity: 0 uniform, > 0 Zipf with this exponent (default: %(default)s)")
    p.add_argument("--no-layerwise-lora-loading", action="store_true",
                   help="copy an adapter in before the step that needs it instead of layer by layer beside it")
    p.add_argument("--lora-target", type=float, default=0.9,
                   help="lora: the SLO attainment a count of adapters must reach (default: %(default)s)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="run: write a PNG of the cluster timeline (phase per instance, prefill windows, "
                        "routed requests) at PATH")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: the TP ranks split the experts (all-to-all) instead of slicing each one")
    p.add_argument("--moe-resident-experts", type=int, default=None,
                   help="MoE models: experts per layer kept on the GPUs, the rest offloaded to host memory "
                        "(default: all on the GPUs)")
    p.add_argument("--expert-skew", type=float, default=0.0,
                   help="MoE offload: Zipf exponent of expert popularity (default 0: uniform routing)")
    p.add_argument("--expert-placement", default="aptmoe", choices=PLACEMENTS,
                   help="MoE offload: misses per the APTMoE policy, all loaded over PCIe, or all computed on the host")
    p.set_defaults(func=main)
    return p


def _moe_knobs(args: argparse.Namespace) -> dict:
    """The performance model's MoE options from the flags (none when they keep their defaults)."""
    knobs = {"expert_parallel": True} if args.enable_expert_parallel else {}
    if args.moe_resident_experts is not None:
        knobs.update(moe_resident_experts=args.moe_resident_experts, expert_skew=args.expert_skew,
                     expert_placement=args.expert_placement)
    return knobs


def main(args: argparse.Namespace) -> int:
    from ecoserve.sim.cluster import ClusterSpec
    from ecoserve.sim.experiments import EXPERIMENTS
    from ecoserve.sim.hardware import GPUS
    from ecoserve.sim.metrics import summarize
    from ecoserve.sim.cluster import build
    from ecoserve.sim.workload import DATASETS, load_trace, synthetic

    out = Path(args.out)
    if args.experiment == "lora":
        return _lora_capacity(args, out)
    if args.experiment != "run":
        import ecoserve.sim.experiments as experiments
        if args.duration:
            experiments.ARRIVAL_S = args.duration
        if args.grid_ratio:
            experiments.CURVE = dataclasses.replace(experiments.CURVE, ratio=args.grid_ratio)
        kw = {"num_requests": args.num_requests} if args.num_requests and args.experiment != "mitosis" else {}
        if args.strategies and args.experiment != "ablation":
            kw["strategies"] = tuple(args.strategies.split(","))
        if args.mitosis_step and args.experiment == "mitosis":
            kw["step_s"] = args.mitosis_step
        if args.models and args.experiment in ("overall", "scaling", "ablation"):
            kw["models"] = tuple(args.models.split(","))
        if args.datasets and args.experiment == "overall":
            kw["datasets"] = tuple(args.datasets.split(","))
        data = EXPERIMENTS.get(args.experiment)(out, **kw)
        print(json.dumps({k: v for k, v in data.items() if k != "results"}, indent=1, default=str)[:4000])
        print(f"wrote {out}/{args.experiment}.json and .png")
        return 0
    ds = DATASETS.get(args.dataset)
    ttft, tpot = args.ttft_slo or ds.ttft_slo, args.tpot_slo or ds.tpot_slo
    spec = ClusterSpec(model=args.model, gpu=GPUS.get(args.gpu).name, tp=args.tp, num_instances=args.num_instances,
                       network=args.network, profile=args.profile, speculation=_speculation(args),
                       perf_knobs=_moe_knobs(args),
                       **({"profile_tokens": _token_counts(args.profile_tokens)} if args.profile_tokens else {}))
    wl = load_trace(args.trace) if args.trace else synthetic(args.dataset, args.rate, args.num_requests or 1000,
                                                             seed=args.seed, arrival=args.arrival, cv=args.cv)
    if args.num_adapters:
        from ecoserve.sim.lora import assign_adapters
        spec.lora = _lora_config(args, args.num_adapters)
        wl = assign_adapters(wl, spec.lora, args.seed)
    router = {"output_hold": args.output_hold == "on"} if args.output_hold is not None else {}
    sim = build(args.strategy, spec, ttft, tpot, router_mode=args.router_mode, router=router)
    res = sim.run(wl, progress=True)
    summary = summarize(res.records, ttft, tpot, res.num_submitted)
    out.mkdir(parents=True, exist_ok=True)
    extra = {k: v for k, v in res.extra.items() if k not in ("timeline", "instances")}
    (out / "run.json").write_text(json.dumps({"summary": summary, "sim_time": res.sim_time,
                                              "instances": res.extra["instances"], "extra": extra}, indent=1))
    print(json.dumps(summary, indent=1))
    if "spec_decode" in res.extra:
        print("speculative decoding:", json.dumps(res.extra["spec_decode"]))
    print(instance_table(res.extra["instances"]))
    if args.plot:
        from ecoserve.sim.timeline_plot import plot_timeline
        plot_timeline(sim.timeline.snapshot(res.sim_time), args.plot, title=f"{args.strategy}: simulated cluster")
        print(f"wrote {args.plot}")
    return 0


def _lora_config(args: argparse.Namespace, num_adapters: int):
    from ecoserve.sim.lora import LoRASimConfig
    return LoRASimConfig(num_adapters, args.lora_rank, args.max_loras, zipf_alpha=args.lora_zipf,
                         layerwise_loading=not args.no_layerwise_lora_loading)


def _lora_capacity(args: argparse.Namespace, out: Path) -> int:
    """`simulate lora`: attainment by number of adapters, per strategy, and the most adapters within target."""
    from ecoserve.sim.lora_experiment import ADAPTER_COUNTS, adapter_capacity, capacity_table

    _lora_config(args, 1)  # refuses bad values before the runs
    top = args.num_adapters or ADAPTER_COUNTS[-1]
    counts = tuple(n for n in ADAPTER_COUNTS if n < top) + (top,)
    from ecoserve.sim.cluster import ClusterSpec
    from ecoserve.sim.hardware import GPUS
    spec = ClusterSpec(model=args.model, gpu=GPUS.get(args.gpu).name, tp=args.tp, num_instances=args.num_instances,
                       network=args.network, profile=args.profile)
    data = adapter_capacity(out, spec, args.dataset, args.rate, args.num_requests or 400,
                            tuple((args.strategies or "ecoserve,vllm").split(",")), args.lora_rank, args.max_loras,
                            counts, args.lora_target, args.lora_zipf, not args.no_layerwise_lora_loading, args.seed)
    print(capacity_table(data))
    print(f"wrote {out}/lora.json")
    return 0


def instance_table(rows: list[dict]) -> str:
    """The per-instance summary as a text table (`-` where a strategy has no windows)."""
    fmt = lambda v, f: "-" if v is None else format(v, f)
    lines = [f"{'id':>3} {'busy':>6} {'windows':>8} {'mean window s':>14} {'routed':>7}"]
    lines += [f"{r['id']:>3} {fmt(r['busy_fraction'], '.2f'):>6} {fmt(r['num_windows'], 'd'):>8} "
              f"{fmt(r['mean_window_s'], '.2f'):>14} {fmt(r['routed_fraction'], '.3f'):>7}" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m ecoserve.sim.cli simulate ...
    parser = argparse.ArgumentParser(prog="ecoserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))


def _token_counts(text: str) -> tuple[int, ...]:
    """`--profile-tokens 16,64,256`: positive token counts."""
    try:
        counts = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--profile-tokens takes comma-separated token counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--profile-tokens takes positive token counts, got {text!r}")
    return counts


def _speculation(args: argparse.Namespace):
    """`--num-speculative-tokens` and its rates as the simulated instances' model; None: no speculation."""
    from ecoserve.sim.speculation import AUTO, SpeculationModel

    k = args.num_speculative_tokens
    if k is None:
        return None
    if k != AUTO:
        try:
            k = int(k)
        except ValueError:
            raise ValueError(f"--num-speculative-tokens takes an integer >= 1 or auto, got {k!r}") from None
    return SpeculationModel(args.spec_acceptance_rate, k, args.spec_draft_cost, seed=args.seed)
