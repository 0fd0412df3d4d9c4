"""ModelSpec: the facts of a HF `config.json` that our model zoo needs, parsed and checked once."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM") + MOE_ARCHITECTURES
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM"}
# transformers' defaults for keys a config.json may leave out
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 131072,
                          "Qwen2ForCausalLM": 32768, "Qwen3ForCausalLM": 32768, "MixtralForCausalLM": 131072,
                          "Qwen2MoeForCausalLM": 32768, "Qwen3MoeForCausalLM": 32768}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class ModelLoadError(ValueError):
    """A model could not be loaded: the message says what was wrong and what would be right."""


def supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3; dynamic uses max_position_embeddings


@dataclass(frozen=True)
class MoESpec:
    """The sparse MLP of a mixture-of-experts model: which layers have it, and how its router weighs experts.

    Each sparse layer's router picks `top_k` of `num_experts` experts per token from softmax(router
    logits) in float32; `norm_topk_prob` renormalises the k picked probabilities to sum to 1 (Mixtral
    always does). Mixtral multiplies the experts' outputs by the float32 weights; the Qwen models first
    round the weights to the model's dtype (`weights_in_model_dtype`), which matters in bfloat16.
    Qwen2-MoE adds a shared expert to every token, scaled by sigmoid(shared_expert_gate(x)).
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool
    weights_in_model_dtype: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: frozenset[int] = frozenset()  # layers with a plain gated MLP instead

    def is_sparse(self, layer: int) -> bool:
        """Whether (global) decoder layer `layer` has the sparse MoE block."""
        return layer not in self.dense_layers

    @property
    def active_fraction(self) -> float:
        """The share of the routed experts' weights one token uses."""
        return self.top_k / self.num_experts


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Recorded only: we always run full causal attention, so outputs equal HF's while a sequence
    # stays within the window (Mistral v0.1 and Qwen with use_sliding_window differ beyond it).
    sliding_window: int | None = None
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoESpec | None = None  # None: every layer has a dense gated MLP
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"no config.json in {path}; a HF checkpoint directory needs config.json "
                                 f"and *.safetensors (supported architectures: {supported_list()})")
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"malformed {config_path}: {e}") from None
        return cls.from_config(config, source=str(config_path))

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config") -> ModelSpec:
        if not isinstance(config, dict):
            raise ModelLoadError(f"malformed {source}: expected a JSON object, got {type(config).__name__}")
        arch = _architecture(config, source)

        def get_int(key: str, default: int | None = None) -> int:
            value = config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                what = "missing" if value is None else f"{value!r}"
                raise ModelLoadError(f"malformed {source}: {key} must be a positive integer, got {what}")
            return value

        hidden, heads = get_int("hidden_size"), get_int("num_attention_heads")
        kv_heads = get_int("num_key_value_heads", heads) if config.get("num_key_value_heads") else heads
        if config.get("head_dim"):
            head_dim = get_int("head_dim")
        elif arch == "Qwen3ForCausalLM":
            head_dim = 128  # transformers' Qwen3Config default when the key is absent
        else:
            if hidden % heads:
                raise ModelLoadError(f"malformed {source}: hidden_size {hidden} is not divisible by "
                                     f"num_attention_heads {heads} and no head_dim is given")
            head_dim = hidden // heads
        if heads % kv_heads:
            raise ModelLoadError(f"malformed {source}: num_attention_heads {heads} must be a multiple of "
                                 f"num_key_value_heads {kv_heads}")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r} in {source}; only 'silu' is supported")
        max_pos = get_int("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
        is_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
        attention_bias = bool(config.get("attention_bias", False))
        if is_qwen:
            window = config.get("sliding_window") if config.get("use_sliding_window") else None
        else:
            window = config.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch, hidden_size=hidden, num_layers=get_int("num_hidden_layers"),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=get_int("intermediate_size"), vocab_size=get_int("vocab_size"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_rope(config, max_pos, source), max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(arch, config, attention_bias),
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            mlp_bias=bool(config.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), sliding_window=window,
            torch_dtype=config.get("dtype") or config.get("torch_dtype"),
            eos_token_ids=eos_ids, moe=_moe(arch, config, get_int, source), raw=config)


def _qkv_bias(arch: str, config: dict[str, Any], attention_bias: bool) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(config.get("qkv_bias", True))
    return attention_bias


def _moe(arch: str, config: dict[str, Any], get_int, source: str) -> MoESpec | None:
    """The MoESpec of a MoE architecture's config (transformers' defaults for absent keys), else None."""
    if arch not in MOE_ARCHITECTURES:
        return None
    num_layers = get_int("num_hidden_layers")
    if arch == "MixtralForCausalLM":
        experts = get_int("num_local_experts", 8)
        top_k = get_int("num_experts_per_tok", 2)
        moe = MoESpec(num_experts=experts, top_k=top_k, intermediate_size=get_int("intermediate_size"),
                      norm_topk_prob=True, weights_in_model_dtype=False)
    else:
        key = "num_experts" if "num_experts" in config else "num_local_experts"  # transformers 5 may write either
        defaults = {"Qwen2MoeForCausalLM": (60, 4, 1408), "Qwen3MoeForCausalLM": (128, 8, 768)}[arch]
        experts = get_int(key, defaults[0])
        top_k = get_int("num_experts_per_tok", defaults[1])
        step = get_int("decoder_sparse_step", 1)
        only = config.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
            raise ModelLoadError(f"malformed {source}: mlp_only_layers must be a list of layer indices, got {only!r}")
        dense = frozenset(i for i in range(num_layers) if i in only or (i + 1) % step)
        shared = get_int("shared_expert_intermediate_size", 5632) if arch == "Qwen2MoeForCausalLM" else 0
        moe = MoESpec(num_experts=experts, top_k=top_k,
                      intermediate_size=get_int("moe_intermediate_size", defaults[2]),
                      norm_topk_prob=bool(config.get("norm_topk_prob", False)), weights_in_model_dtype=True,
                      shared_expert_intermediate_size=shared, dense_layers=dense)
    if moe.top_k > moe.num_experts:
        raise ModelLoadError(f"malformed {source}: num_experts_per_tok {moe.top_k} exceeds the "
                             f"{moe.num_experts} experts")
    return moe


def _architecture(config: dict[str, Any], source: str) -> str:
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelLoadError(f"malformed {source}: architectures must be a list, got {archs!r}")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and config.get("model_type") in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[config["model_type"]]
    found = archs or config.get("model_type") or "none"
    raise ModelLoadError(f"unsupported architecture {found!r} in {source}; supported architectures: "
                         f"{supported_list()}")


def _rope(config: dict[str, Any], max_pos: int, source: str) -> RopeSpec:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote `rope_theta` + `rope_scaling`
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope type {rope_type!r} in {source}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return RopeSpec(theta=theta)
    if "factor" not in params:
        raise ModelLoadError(f"malformed {source}: rope type {rope_type!r} needs a 'factor'")
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    return RopeSpec(theta=theta, rope_type=rope_type, factor=float(params["factor"]),
                    low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(original or max_pos))
