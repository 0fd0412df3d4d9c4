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
- Host CPUs (where offloaded experts live): Intel ARK (Xeon Gold 6348: 28 cores at 2.6 GHz, two
  AVX-512 FMA units -> 32 FP32 FLOP/cycle/core, 8 channels of DDR4-3200 = 204.8 GB/s; Xeon Platinum
  8480+: 56 cores at 2.0 GHz, AMX BF16 ~1024 FLOP/cycle/core, 8 channels of DDR5-4800 = 307 GB/s).
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


@dataclass(frozen=True)
class CPU:
    """One host socket, where offloaded expert weights live and may be computed."""

    name: str
    flops: float  # FLOP/s, peak, in the dtype experts run at on the host
    mem_bandwidth: float  # bytes/s, peak
    flops_efficiency: float = 0.5  # assumed: small GEMMs on many cores
    bandwidth_efficiency: float = 0.7  # assumed: STREAM-like fraction of peak


GPUS: Registry[GPU] = Registry("GPU")
CPUS: Registry[CPU] = Registry("CPU")
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


for _cpu in (
    CPU("xeon-6348", 28 * 2.6e9 * 32, 204.8 * GB),
    CPU("xeon-8480", 56 * 2.0e9 * 1024, 307.2 * GB),
):
    CPUS.add(_cpu.name, _cpu)


def cpu(name: str) -> CPU:
    return CPUS.get(name)


def gpu(name: str) -> GPU:
    return GPUS.get(name)


def link(name: str) -> Link:
    return LINKS.get(name)
