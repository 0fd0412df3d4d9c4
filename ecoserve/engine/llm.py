"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from ecoserve.config import EngineArgs
from ecoserve.engine.llm_engine import LLMEngine, PromptType
from ecoserve.request import LoRARequest, RequestOutput
from ecoserve.sampling import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: the fields of `EngineArgs` (vLLM's names: max_num_seqs, max_model_len, ...)."""
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model, **kwargs).create_engine_config())
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**self.llm_engine.loaded.generation_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or a list with one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        engine = self.llm_engine
        for lora in dict.fromkeys(l for l in loras if l is not None):  # a bad adapter fails before anything is queued
            engine.lora_manager().register(lora)
        # Validate everything first so that one bad prompt leaves nothing half-queued.
        tokenized = [engine.tokenize_prompt(p) for p in prompts]
        for i, (_, ids) in enumerate(tokenized):
            try:
                engine.validate_prompt(ids)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        order = {}
        for (text, ids), p, lora in zip(tokenized, params, loras):
            rid = str(next(self._ids))
            order[rid] = len(order)
            engine.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, p, lora_request=lora)
        return self._run(order, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.encode_chat(c, add_generation_prompt)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        tok = self.llm_engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return tok.encode(text, add_special_tokens=False)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while any(r is None for r in results) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
                for request_id, error in engine.take_failed().items():
                    if request_id in order:  # one of ours failed alone (its grammar, its own processing)
                        raise type(error)(f"prompt {order[request_id]}: {error}") from error
                grammar_wait = engine.grammar_wait_s() if engine.last_step_empty else None
                if grammar_wait is not None:  # only grammars compiling: wait for one, do not spin
                    engine.wait_for_grammars(grammar_wait)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return results
