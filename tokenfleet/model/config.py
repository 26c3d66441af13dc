"""The shape of a Llama-family decoder, read once from a Hugging Face `config.json`.

One decoder serves several open families; each is a variation the config names:

    llama    (as published; optional biases on every attention / MLP projection)
    mistral  Llama's shape; its sliding window run on every layer (exact at any length)
    qwen2    bias on the q/k/v projections (not on o); a sliding window, when switched
             on, on the layers from max_window_layers (as for qwen3)
    qwen3    per-head RMSNorm of q and k before the rotary embedding, no bias
    phi3     Llama's math; the checkpoint stores q/k/v and gate/up already fused
             (a sliding window run on every layer, as for mistral)
    gemma3   (the text model) norms that scale by (1 + weight) in fp32, four per layer
             (around attention and around the MLP), q/k norms, embeddings scaled by
             sqrt(hidden), GeGLU, queries scaled by query_pre_attn_scalar ** -0.5, and
             sliding-window layers (their own rope base) between global ones
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfleet.errors import ModelConfigError

# model_type -> the architecture class transformers saves it as
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# model_type names that load as a family of another name
MODEL_TYPE_ALIASES = {"gemma3_text": "gemma3"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU, GeGLU (tanh approximation)
SLIDING, FULL = "sliding_attention", "full_attention"
SUPPORTED_ARCHITECTURES = frozenset(FAMILIES.values())
SUPPORTED_MODEL_TYPES = frozenset(FAMILIES) | frozenset(MODEL_TYPE_ALIASES)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent stretch of the rotary frequencies."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ModelConfigError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ModelConfigError(
                "rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ModelConfigError("rope scaling original_max_position_embeddings must be >= 1")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about a checkpoint's shape.

    Validated on construction: a config that reaches the model can be run.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False  # bias on q, k, v and o
    mlp_bias: bool = False
    qkv_bias: bool = False  # bias on q, k and v only (qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (qwen3)
    family: str = "llama"
    hidden_act: str = "silu"  # the MLP's gate activation, one of ACTIVATIONS
    # Per layer SLIDING or FULL (empty: every layer FULL). A sliding layer attends to the
    # last `sliding_window` positions (its own included) with rope base `rope_local_theta`.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # scores scale by its ** -0.5 (gemma3)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings: {self.head_dim}")
        if self.family not in FAMILIES:
            raise ModelConfigError(f"unknown family {self.family!r}; supported: {sorted(FAMILIES)}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ModelConfigError("rms_norm_eps and rope_theta must be > 0")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {ACTIVATIONS}"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ModelConfigError(
                    f"{len(self.layer_types)} layer_types for {self.num_layers} layers"
                )
            if set(self.layer_types) - {SLIDING, FULL}:
                raise ModelConfigError(f"layer_types must be {SLIDING!r} or {FULL!r}")
            if SLIDING in self.layer_types and not (
                self.sliding_window and self.sliding_window > 0 and self.rope_local_theta
            ):
                raise ModelConfigError(
                    "sliding layers need sliding_window > 0 and rope_local_theta"
                )
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar <= 0:
            raise ModelConfigError("query_pre_attn_scalar must be > 0")
        bos = () if self.bos_token_id is None else (self.bos_token_id,)
        for tid in (*self.eos_token_ids, *bos):
            if not 0 <= tid < self.vocab_size:
                raise ModelConfigError(f"special token id {tid} outside vocab {self.vocab_size}")

    # ---- derived quantities -------------------------------------------------

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias or self.qkv_bias

    @property
    def gemma_norms(self) -> bool:
        """Gemma's norms: (1 + weight) scaling in fp32 (the model keeps 1 + weight, as
        llama.cpp stores it), a norm after attention and after the MLP too."""
        return self.family == "gemma3"

    @property
    def embed_scale(self) -> float | None:
        """What the token embeddings are multiplied by (gemma3: sqrt(hidden))."""
        return self.hidden_size**0.5 if self.family == "gemma3" else None

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for a layer that sees the whole context."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @property
    def query_scale(self) -> float:
        """The factor on q that turns attention's head_dim ** -0.5 into
        query_pre_attn_scalar ** -0.5 (1.0 when they agree)."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return float((self.head_dim / self.query_pre_attn_scalar) ** 0.5)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def param_count(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        attn = h * (q_out + 2 * kv_out) + q_out * h
        if self.has_qkv_bias:
            attn += q_out + 2 * kv_out
        if self.attention_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * h * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        per_layer = attn + mlp + (4 if self.gemma_norms else 2) * h  # + the RMSNorm weights
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + h + head

    def scratch_bytes(
        self,
        num_tokens: int,
        *,
        context_len: int | None = None,
        logit_rows: int | None = None,
        dtype_bytes: int = 4,
    ) -> int:
        """Peak activation memory of one forward over `num_tokens` new tokens (an estimate).

        Layers run one after another, so only one layer's temporaries are live at
        once. `context_len` is the longest context a query attends over (default:
        `num_tokens`, a prefill from position 0); the attention-score term is the
        largest for long prefill chunks. `logit_rows` defaults to `num_tokens`, an
        upper bound (the model computes logits only for each sequence's last token).
        """
        t = num_tokens
        ctx = t if context_len is None else context_len
        rows = t if logit_rows is None else logit_rows
        h, hd, db = self.hidden_size, self.head_dim, dtype_bytes
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        # residual stream, its normed copy and the sublayer output: [T, hidden] each
        base = 3 * t * h * db
        attn = t * (q_out + 2 * kv_out) * db  # fused qkv projection
        attn += t * (q_out + kv_out) * db  # rotated q and k
        attn += t * q_out * db  # attention output
        attn += 2 * ctx * kv_out * db  # K/V gathered from the pool
        attn += 2 * self.num_heads * t * ctx * 4  # scores and softmax, fp32 worst case
        # fused gate/up [T, 2I], silu(gate) and the product [T, I] each
        mlp = 4 * t * self.intermediate_size * db
        logits = rows * self.vocab_size * (db + 4)  # model-dtype logits + their float32 copy
        return base + max(attn, mlp) + logits

    # ---- construction -------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        archs = d.get("architectures")
        if archs and not SUPPORTED_ARCHITECTURES.intersection(archs):
            raise ModelConfigError(
                f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = d.get("model_type")
        if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type is None and archs:
            by_arch = {arch: fam for fam, arch in FAMILIES.items()}
            model_type = next(by_arch[a] for a in archs if a in by_arch)
        family = MODEL_TYPE_ALIASES.get(model_type or "llama", model_type or "llama")
        act = d.get("hidden_act", "silu")
        if family != "gemma3" and act != "silu":
            raise ModelConfigError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU)")
        gemma = _read_gemma3(d) if family == "gemma3" else {}
        rotary = (d.get("rope_parameters") or {}).get(
            "partial_rotary_factor", d.get("partial_rotary_factor", 1.0)
        )
        if rotary not in (None, 1, 1.0):
            raise ModelConfigError(f"partial rotary embeddings ({rotary}) are not supported")
        if d.get("pretraining_tp", 1) not in (None, 1):
            raise ModelConfigError("pretraining_tp > 1 checkpoints are not supported")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            head_dim = d.get("head_dim") or hidden // heads
            theta, scaling = (gemma.pop("rope_theta"), None) if gemma else _read_rope(d)
            windows = _read_windows(d, family, theta)
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=_context_length(d, family),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                qkv_bias=family == "qwen2",
                qk_norm=family in ("qwen3", "gemma3"),
                family=family,
                **gemma,
                **windows,
            )
        except KeyError as e:
            raise ModelConfigError(f"config is missing required key {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"config has a malformed value: {e}") from e

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError as e:
            raise ModelConfigError(f"no model config at {p}") from e
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{p} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ModelConfigError(f"{p} must hold a JSON object")
        return cls.from_hf_dict(d)


def _context_length(d: dict[str, Any], family: str) -> int:
    """The longest context served: every family's sliding windows are run as windows
    (Gemma 3's `_read_gemma3`, the others' `_read_windows`), exact at any length."""
    return int(d.get("max_position_embeddings", 2048))


def _read_windows(d: dict[str, Any], family: str, theta: float) -> dict[str, Any]:
    """The sliding windows of the families other than Gemma 3 (`ModelConfig` keywords),
    as transformers runs them, with the model's one rope base: Mistral and Phi-3 window
    every layer when `sliding_window` is set; Qwen2 and Qwen3 only when
    `use_sliding_window` is on, the layers its `layer_types` says or else those from
    `max_window_layers` on."""
    window = d.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return {}
    layers = int(d["num_hidden_layers"])
    if family in ("mistral", "phi3") and d.get("use_sliding_window", True):
        types = [SLIDING] * layers
    elif family in ("qwen2", "qwen3") and d.get("use_sliding_window", False):
        first = int(d.get("max_window_layers", 28))
        types = list(
            d.get("layer_types") or [SLIDING if i >= first else FULL for i in range(layers)]
        )
    else:
        return {}
    if SLIDING not in types:
        return {}
    return {"layer_types": tuple(types), "sliding_window": window, "rope_local_theta": theta}


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,) if value >= 0 else ()
    return tuple(int(v) for v in value if int(v) >= 0)


def _read_rope(d: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """rope_theta and scaling from either `rope_parameters` (transformers 5) or the
    older top-level `rope_theta` + `rope_scaling` pair."""
    params: dict[str, Any] = dict(d.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling: dict[str, Any] = params if "rope_type" in params else dict(d.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelConfigError(f"unsupported rope scaling {rope_type!r}; supported: llama3")
    try:
        return theta, Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelConfigError(f"llama3 rope scaling is missing {e.args[0]!r}") from e


def _read_gemma3(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's extra fields (`ModelConfig` keywords, plus "rope_theta") from a
    `Gemma3TextConfig` dict: transformers 5's per-layer-type `rope_parameters` or 4.x's
    `rope_theta` + `rope_local_base_freq`."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise ModelConfigError(f"gemma3 {key} is not supported")
    if d.get("use_bidirectional_attention"):
        raise ModelConfigError("gemma3 with bidirectional attention is not supported")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if not types:
        pattern = int(d.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    params: dict[str, Any] = dict(d.get("rope_parameters") or {})
    full = dict(params.get(FULL) or {})
    local = dict(params.get(SLIDING) or {})
    rope_scaling = d.get("rope_scaling") or {}
    for kind in (full.get("rope_type"), local.get("rope_type"), rope_scaling.get("rope_type")):
        if kind not in (None, "default"):
            raise ModelConfigError(f"gemma3 rope scaling {kind!r} is not supported")
    window = d.get("sliding_window")
    return {
        "hidden_act": act,
        "layer_types": tuple(types),
        "sliding_window": None if window is None else int(window),
        "rope_theta": float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        "rope_local_theta": float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))),
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
    }
