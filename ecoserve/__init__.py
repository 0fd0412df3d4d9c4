"""EcoServe: LLM serving for commodity GPU clusters."""
from ecoserve.request import CompletionOutput, LoRARequest, RequestOutput
from ecoserve.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import ecoserve` must not pay for torch/transformers (the simulator needs neither).
    if name == "LLM":
        from ecoserve.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from ecoserve.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
