"""Architecture name (config.json `architectures`) -> model class."""
from __future__ import annotations

from torch import nn

from ecoserve.model.llama import LlamaModel
from ecoserve.model.spec import SUPPORTED_ARCHITECTURES, ModelLoadError, supported_list

# Mistral, Qwen2 and Qwen3 are Llama with flags (qkv bias, q/k norm) that ModelSpec sets
MODEL_REGISTRY: dict[str, type[nn.Module]] = {arch: LlamaModel for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: {supported_list()}") from None
