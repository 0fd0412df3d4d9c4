"""Shared test helpers: a tiny in-process tokenizer, tiny random HF checkpoints, HF references.

Every correctness test compares ecoserve with HF transformers through `hf_greedy` /
`hf_logprobs` / `hf_logits` (batch 1, no padding, greedy), so all tests use one reference.
Keep this API stable: other test packages import it.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from pathlib import Path
from typing import Any

import torch

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Chat turns are `<|role|>\ncontent</s>\n`; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time there was a small village at the edge of a great forest. The people of the village
grew wheat and barley, kept goats and bees, and told stories in the evening by the fire.
Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.
Madrid is the capital of Spain, and Lisbon is the capital of Portugal. London is a large city.
Computers follow instructions written by programmers. A program reads input, computes, and writes output.
Numbers: one two three four five six seven eight nine ten eleven twelve 0 1 2 3 4 5 6 7 8 9 10 100 1000.
What is your name? How are you today? Where do you live? Why is the sky blue? When will it rain?
The weather was cold and windy, so she wore a warm coat, a hat and gloves before going outside.
Language models predict the next token of a text. Serving them quickly needs batching and caching.
Hello, world! Thank you very much. Please answer the question in one short sentence.
The sun rises in the east and sets in the west. Water boils at one hundred degrees Celsius.
Cats and dogs are popular pets; birds sing in the morning, and fish swim in the river near the hill.
"""
VOCAB_SIZE = 512

_ARCHS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
          "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig"}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD, BOS, EOS, *ROLE_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok.to_str()


def make_tokenizer():
    """A ~500-token byte-level BPE (pad=0, bos=1, eos=2, role tokens 3-5) with a chat template.

    `encode` adds no special tokens; the chat template starts with BOS. Trained once per
    process; each call returns a fresh wrapper, so callers may mutate it.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS), chat_template=CHAT_TEMPLATE)


def make_tiny_checkpoint(path: str | Path, arch: str = "llama", *, num_layers: int = 2,
                         tie_word_embeddings: bool = False, rope_scaling: dict[str, Any] | None = None,
                         max_shard_size: str | int | None = None, initializer_range: float = 0.15,
                         seed: int = 0, generation_config: dict[str, Any] | None = None,
                         **config_overrides: Any) -> Path:
    """Write a random-weight HF checkpoint (float32 safetensors + tokenizer + generation_config).

    arch: llama | mistral | qwen2 | qwen3 | mixtral | qwen2_moe | qwen3_moe (MoE keys via overrides). `rope_scaling` e.g. {"rope_type": "linear", "factor": 2.0}.
    `max_shard_size` (e.g. "20KB") writes sharded safetensors with an index. The wide
    initializer_range keeps argmax margins large, so greedy comparisons are not flaky.
    """
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {', '.join(_ARCHS)}, got {arch!r}")
    path = Path(path)
    tokenizer = make_tokenizer()
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=initializer_range, tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    rope = {"rope_type": "default", "rope_theta": config_overrides.pop("rope_theta", 10000.0)}
    rope.update(rope_scaling or {})
    kwargs["rope_parameters"] = rope
    kwargs.update(config_overrides)
    config = getattr(transformers, _ARCHS[arch])(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_norm_weights(model, seed)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    gen = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    gen.update(generation_config or {})
    GenerationConfig(**gen).save_pretrained(path)
    return path


# tiny MoE configs: more experts than top-k; Qwen2-MoE with its shared expert, Qwen3-MoE with a dense layer
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[1], num_hidden_layers=3),
}


def make_tiny_moe_checkpoint(path: str | Path, arch: str, **overrides: Any) -> Path:
    """A random tiny Mixtral, Qwen2-MoE or Qwen3-MoE checkpoint (MOE_CONFIGS, then `overrides`)."""
    kwargs = {**MOE_CONFIGS[arch], **overrides}
    return make_tiny_checkpoint(path, arch, num_layers=kwargs.pop("num_hidden_layers", 2), **kwargs)


def _spread_norm_weights(model: torch.nn.Module, seed: int) -> None:
    # HF initialises norm weights to 1 and biases to 0; random values also exercise those paths
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.norm.weight":  # wider logits: larger argmax margins
                p.copy_(2.5 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


@functools.lru_cache(maxsize=16)
def _hf_model(path: str, mtime_ns: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The HF transformers model of a checkpoint directory (cached per process)."""
    path = Path(path)
    return _hf_model(str(path), (path / "config.json").stat().st_mtime_ns, dtype)


def hf_logits(path: str | Path, token_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF float32 logits [len(token_ids), vocab] of one sequence starting at position 0."""
    with torch.no_grad():
        out = hf_model(path, dtype)(torch.tensor([token_ids]))
    return out.logits[0].float()


def _greedy_steps(path: str | Path, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool,
                  dtype: torch.dtype) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy decoding with its KV cache, one token at a time: (new tokens, raw logits per step).

    A plain loop rather than `generate`, so that ignore_eos never masks EOS (it only does not stop).
    """
    model = hf_model(path, dtype)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    tokens, logits_per_step, past = [], [], None
    # transformers renamed past_key_values to cache (5.2x); support both
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(ids, **{cache_kw: past}, use_cache=True)
            past = out[cache_kw]
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logits_per_step.append(logits)
            if token in eos and not ignore_eos:
                break
            ids = torch.tensor([[token]])
    return tokens, logits_per_step


def hf_greedy_logits(path: str | Path, prompt_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False,
                     dtype: torch.dtype = torch.float32) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy continuation and the float32 logits [vocab] each of its tokens was chosen from."""
    return _greedy_steps(path, prompt_ids, max_new_tokens, ignore_eos, dtype)


def hf_greedy(path: str | Path, prompt_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False,
              dtype: torch.dtype = torch.float32) -> list[int]:
    """HF greedy continuation of one prompt: the new tokens, ending with EOS if it was generated."""
    return _greedy_steps(path, prompt_ids, max_new_tokens, ignore_eos, dtype)[0]


def hf_logprobs(path: str | Path, prompt_ids: list[int], max_new_tokens: int, num_logprobs: int = 5, *,
                ignore_eos: bool = False, dtype: torch.dtype = torch.float32) -> tuple[list[int], list[dict[int, float]]]:
    """HF greedy tokens and, per generated token, the top-`num_logprobs` {token_id: logprob} plus the chosen one."""
    tokens, step_logits = _greedy_steps(path, prompt_ids, max_new_tokens, ignore_eos, dtype)
    steps = []
    for token, logits in zip(tokens, step_logits):
        logprobs = torch.log_softmax(logits, dim=-1)
        top = logprobs.topk(num_logprobs)
        entry = dict(zip(top.indices.tolist(), top.values.tolist()))
        entry[token] = logprobs[token].item()
        steps.append(entry)
    return tokens, steps


def prompts(n: int = 8, seed: int = 0, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    """Deterministic random prompts of varied length over the tiny tokenizer's ordinary tokens."""
    gen = torch.Generator().manual_seed(seed)
    low = 3 + len(ROLE_TOKENS)  # skip pad/bos/eos and role tokens
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        out.append(torch.randint(low, VOCAB_SIZE, (length,), generator=gen).tolist())
    return out


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


class DenseCausalAttention:
    """Test backend: all tokens of the step are one sequence starting at position 0; no KV cache."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1)


class PerSequenceAttention:
    """Test backend for a flattened batch of whole sequences: causal attention within each one, no cache."""

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = list(seq_lens)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        dense = DenseCausalAttention()
        return torch.cat([dense(layer_idx, qs, ks, vs, scale) for qs, ks, vs in
                          zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens))])


def dense_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """ecoserve model, greedy, recomputing the whole sequence each token (no KV cache): a cache-free reference."""
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention())
            token = int(model.compute_logits(hidden[-1:]).argmax(-1))
            out.append(token)
            ids.append(token)
    return out


def llama_cpp_permute(w, n_heads: int):
    """llama.cpp's q/k row order (numpy [rows, cols]): each head's two rotary halves interleaved row by row."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
# llama.cpp's architecture per model_type (Mixtral is llama with experts) and its stacked expert tensors
_GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_GGUF_EXPERTS = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps", "up_proj": "ffn_up_exps",
                 "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}


def make_tiny_gguf(ckpt: str | Path, out: str | Path, quant_type: Any = None) -> Path:
    """Write a GGUF (weights, metadata, tokenizer, chat template) of a tiny llama, Mixtral, Qwen2-MoE or Qwen3-MoE
    checkpoint as llama.cpp lays it out: float32, or with its matrices in `quant_type` (a gguf.GGMLQuantizationType
    such as Q4_0; norms stay float32). Experts are stacked per layer into ffn_{gate,up,down}_exps."""
    import numpy as np
    from gguf import GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    ckpt, out = Path(ckpt), Path(out)
    cfg = read_json(ckpt / "config.json")
    if cfg.get("model_type") not in _GGUF_ARCH:
        raise ValueError(f"make_tiny_gguf writes {', '.join(_GGUF_ARCH)} checkpoints, got {cfg.get('model_type')!r}")
    arch = _GGUF_ARCH[cfg["model_type"]]
    w = GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["head_dim"])
    tok = json.loads(make_tokenizer().backend_tokenizer.to_str())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])  # 3: control token
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    for name, t in load_file(ckpt / "model.safetensors").items():
        a = t.numpy()
        parts = name.split(".")
        if len(parts) == 8 and parts[4] == "experts":  # model.layers.N.<block>.experts.E.<proj>.weight
            stacks.setdefault(f"blk.{parts[2]}.{_GGUF_EXPERTS[parts[6]]}.weight", {})[int(parts[5])] = a
            continue
        if name in _GGUF_NAMES:
            gguf_name = _GGUF_NAMES[name]
        else:
            parts = name.split(".")  # model.layers.N.<module>.<weight|bias>
            gguf_name = f"blk.{parts[2]}.{_GGUF_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, cfg["num_key_value_heads"])
        tensors[gguf_name] = a
    tensors.update({n: np.stack([per[e] for e in sorted(per)]) for n, per in stacks.items()})
    for gguf_name, a in tensors.items():
        if quant_type is not None and a.ndim >= 2 and "ffn_gate_inp" not in gguf_name:
            w.add_tensor(gguf_name, quantize(np.ascontiguousarray(a), quant_type), raw_dtype=quant_type)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def serve_in_thread(app, timeout: float = 30.0):
    """`app` on uvicorn in a daemon thread on a free loopback port, once it is serving: (url, server, thread)."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


async def stream_gaps(url: str, started: asyncio.Event, prompt: str = "the stream",
                      max_tokens: int = 200) -> list[float]:
    """The gaps between the events of a greedy streaming completion, from its first event on; `started` is set
    at the first event."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    gaps, last = [], None
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                started.set()
    return gaps
