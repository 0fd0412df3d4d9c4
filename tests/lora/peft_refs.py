"""Random PEFT adapters for the tiny test checkpoints, and HF + peft references (PeftModel and merged)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch


def make_adapter(base: str | Path, out: str | Path, *, r: int = 8, alpha: int = 16,
                 targets: tuple[str, ...] = ("q_proj", "v_proj"), use_rslora: bool = False, seed: int = 0) -> Path:
    """Save a PEFT LoRA adapter with random A and B (init_lora_weights=False) for the checkpoint at `base`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # peft's random B is small; widen it so adapters change greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(out)
    return Path(out)


@functools.lru_cache(maxsize=16)
def _reference_model(base: str, adapter: str, merged: bool):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter)
    if merged:
        model = model.merge_and_unload()
    return model.eval()


@torch.no_grad()
def peft_greedy(base: str | Path, adapter: str | Path, prompt: list[int], max_new_tokens: int,
                merged: bool = False) -> tuple[list[int], list[float]]:
    """Greedy tokens (stopping after EOS) and each chosen token's logprob under HF + peft."""
    model = _reference_model(str(base), str(adapter), merged)
    eos = model.config.eos_token_id
    ids = list(prompt)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
        if token == eos:
            break
    return tokens, logprobs
