"""GPU and interconnect catalogue for the performance model.

Numbers are peak (datasheet) values; the performance model applies efficiencies on top. Sources:
- L20: NVIDIA L20 product brief / spec aggregators (48 GB GDDR6, 864 GB/s, ~119.5 dense BF16
  TFLOP/s); efficiencies calibrated on the TD-Pipe L20 Llama-2-13B profile (see perf.py).
- A800 80GB PCIe, A100 80GB SXM: NVIDIA A100 datasheet (312 dense BF16 TFLOP/s; 1,935 / 2,039 GB/s).
- H100 SXM, H200 SXM: NVIDIA H100 / H200 datasheets (989 dense BF16 TFLOP/s; 3.35 / 4.8 TB/s).
- RTX 4090: NVIDIA Ada Lovelace architecture whitepaper (165.2 BF16 TFLOP/s with FP32 accumulate,
  1,008 GB/s).
- PCIe: PCI-SIG base specifications (4.0 x16: 31.5 GB/s per direction; 5.0 x16: 63 GB/s).
- NVLink: NVIDIA A100 (NVLink 3, 300 GB/s per direction) and H100 (NVLink 4, 450 GB/s) datasheets.
- Ethernet: IEEE 802.3 line rates; RoCE / InfiniBand NDR: NVIDIA ConnectX-7 / Quantum-2 briefs.
Latencies are typical one-way figures (our estimate), not datasheet values.
"""
from __future__ import annotations

from dataclasses import dataclass

from ecoserve.registry import Registry

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    mem_bandwidth: float  # bytes/s, peak
    bf16_flops: float  # dense tensor-core FLOP/s, peak
    # Default fractions of peak the performance model reaches (calibrated for L20, assumed elsewhere).
    flops_efficiency: float = 0.85
    bandwidth_efficiency: float = 0.88
    intra_node_link: str = "pcie4"


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s, per direction
    latency: float  # seconds, one way
    efficiency: float = 0.8  # achievable fraction of the line rate


GPUS: Registry[GPU] = Registry("GPU")
LINKS: Registry[Link] = Registry("link")

for _gpu in (
    GPU("L20", 48 * GB, 864 * GB, 119.5 * TFLOPS, flops_efficiency=0.93, bandwidth_efficiency=0.85),
    GPU("A800", 80 * GB, 1935 * GB, 312 * TFLOPS),
    GPU("A100", 80 * GB, 2039 * GB, 312 * TFLOPS, intra_node_link="nvlink3"),
    GPU("H100", 80 * GB, 3350 * GB, 989 * TFLOPS, flops_efficiency=0.75, intra_node_link="nvlink4"),
    GPU("H200", 141 * GB, 4800 * GB, 989 * TFLOPS, flops_efficiency=0.75, intra_node_link="nvlink4"),
    GPU("RTX4090", 24 * GB, 1008 * GB, 165.2 * TFLOPS),
):
    GPUS.add(_gpu.name, _gpu)

for _link in (
    Link("pcie4", 31.5 * GB, 2e-6, efficiency=0.75),
    Link("pcie5", 63 * GB, 2e-6, efficiency=0.75),
    Link("nvlink3", 300 * GB, 1e-6, efficiency=0.8),
    Link("nvlink4", 450 * GB, 1e-6, efficiency=0.8),
    Link("10gbe", 1.25 * GB, 30e-6, efficiency=0.9),
    Link("25gbe", 3.125 * GB, 20e-6, efficiency=0.9),
    Link("100gbe", 12.5 * GB, 10e-6, efficiency=0.9),
    Link("roce25", 3.125 * GB, 5e-6, efficiency=0.9),
    Link("roce100", 12.5 * GB, 5e-6, efficiency=0.9),
    Link("ib400", 50 * GB, 2e-6, efficiency=0.9),
):
    LINKS.add(_link.name, _link)


def gpu(name: str) -> GPU:
    return GPUS.get(name)


def link(name: str) -> Link:
    return LINKS.get(name)
