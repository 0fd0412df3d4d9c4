"""The quantized matmuls of one batch-1 decode token, alone: SmolLM2-135M's shapes (30 layers of Q4_1
qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, and a Q8_0 49152x576 LM head), each layer's
weights distinct so they stream from L3 or memory as in a decode, not from L2 as a repeated single
layer would. Prints wall and process CPU ms per token and the bytes read per second.

    PYTHONPATH=$PWD python scripts/bench_quant_stream.py --threads 1 --tokens 20
"""
from __future__ import annotations

import argparse
import time

import torch

from ecoserve.model import quant

LAYERS = 30
SHAPES = [(960, 576, 3), (576, 576, 3), (3072, 576, 3), (576, 1536, 3)]  # (out, in, GGML type)
LM_HEAD = (49152, 576, 8)


def random_blocks(n: int, k: int, ggml_type: int, gen: torch.Generator) -> torch.Tensor:
    """Blocks of random quants with small finite fp16 scales (random bytes there could be NaN)."""
    w = torch.randint(0, 256, (n, quant.row_bytes(ggml_type, k)), dtype=torch.uint8, generator=gen)
    blocks = w.view(n, k // 32, -1)
    blocks[..., 0:2] = torch.full((n, k // 32, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    if ggml_type == 3:
        blocks[..., 2:4] = torch.full((n, k // 32, 1), -0.01, dtype=torch.float16).view(torch.uint8)
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    native = quant._native()
    if native is None:
        raise SystemExit("the native quant_matmul kernel is not built")
    gen = torch.Generator().manual_seed(0)
    layers = [[random_blocks(*shape, gen) for shape in SHAPES] for _ in range(LAYERS)]
    head = random_blocks(*LM_HEAD, gen)
    x = {576: torch.randn(1, 576, generator=gen), 1536: torch.randn(1, 1536, generator=gen)}
    calls = [(x[k], w, t) for ws in layers for (_, k, t), w in zip(SHAPES, ws)] + [(x[576], head, 8)]
    nbytes = sum(w.numel() for _, w, _ in calls)

    def token() -> None:
        for xs, w, t in calls:
            native.quant_linear(xs, w, t)

    for _ in range(2):
        token()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(args.tokens):
        token()
    wall, cpu = (time.perf_counter() - t0) / args.tokens, (time.process_time() - cpu0) / args.tokens
    print(f"quant_matmul ({native.isa()}), {args.threads} thread(s): {1e3 * wall:.2f} ms wall, {1e3 * cpu:.2f} ms "
          f"process CPU per token; {nbytes / 2**20:.0f} MiB of blocks at {nbytes / wall / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
