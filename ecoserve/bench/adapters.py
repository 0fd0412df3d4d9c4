"""Random LoRA adapters for serving benchmarks and tests: PEFT's checkpoint layout (`adapter_config.json` +
`adapter_model.safetensors`, tensors named as `save_pretrained` names them) for a Llama-shaped HF model,
written without the `peft` library, with A and B both random (PEFT's default B = 0 would change nothing).

Unlike `bench/lora.py`'s writer, which reads the shapes off a loaded engine, this one needs only the
checkpoint's `config.json`, so the adapters can be written before any server (ours or a peer) starts.
"""
from __future__ import annotations

import json
from pathlib import Path

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_PROJECTIONS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of one decoder layer of an HF Llama-style config."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def random_lora_adapter(base: str | Path, out: str | Path, rank: int = 8, seed: int = 0,
                        targets: tuple[str, ...] = ("q_proj", "v_proj"), scale: float = 0.3) -> Path:
    """Write an adapter of `rank` on `targets` for the checkpoint folder `base` into `out` (created)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(base) / "config.json").read_text())
    shapes = projection_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            block = "self_attn" if proj in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
         "base_model_name_or_path": str(base), "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0}))
    return out
