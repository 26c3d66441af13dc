"""Load a llama.cpp GGUF checkpoint (Llama, Qwen2, Qwen3, Phi-3 or Gemma 3) onto a device.

A GGUF file holds the config and the tokenizer as metadata and every tensor in
one of ggml's formats (F32, F16, BF16, Q8_0, Q4_K, ...). Loading reads the
metadata into a `ModelConfig`, walks the tensors as raw quantized rows
(`iter_raw_tensors`, the seam a quantized runner can take over later),
dequantizes each one to float32, casts and places it, and hands the Hugging
Face-named result to the same builder the folder loader uses.

GGUF lists a tensor's dims fastest-first, so a torch `[out, in]` matrix is
stored as `[in, out]`; the reader already exposes numpy data in torch order
(rows = out features, each row `in` elements or its quantized bytes).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tokenfleet.errors import ModelConfigError, ModelLoadError
from tokenfleet.model.build import LoadedModel, build_model
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.gguf_fields import field_value
from tokenfleet.model.gguf_tokenizer import tokenizer_from_gguf
from tokenfleet.model.quant import PackedWeight, Q4Fields
from tokenfleet.model.weights import check_hf_names, hf_weight_shapes, to_model_state

# `general.architecture` -> the family it loads as. llama.cpp names Mistral 7B-style
# checkpoints "llama" too (its converter writes them as Llama).
ARCHITECTURE_FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_FAMILIES)
# Only the Llama converter permutes q/k rows (to GPT-J-style rotary pairs); Qwen and
# Phi-3 are converted as they are, because llama.cpp runs them with NeoX rope.
_PERMUTED_QK = frozenset({"llama"})

# GGUF tensor name -> Hugging Face name; `{i}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: stored fused, rows [q | k | v]
}
# Phi-3's `ffn_up` holds gate and up fused, rows [gate | up] (llama.cpp splits it
# in half at run time, gate first), exactly like Hugging Face's gate_up_proj.
# Gemma 3 has four layer norms; its `ffn_norm` is the MLP's input norm, as for Llama,
# but Hugging Face names that one `pre_feedforward_layernorm`.
_FAMILY_BLOCK_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# llama.cpp's Gemma 3 settings that its files do not carry (llama-model.cpp): the
# sliding layers' rope base, every 6th layer global unless the file says otherwise.
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_27B_LAYERS = 62  # the one size whose queries scale by (hidden / heads) ** -0.5
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class RawTensor:
    """One checkpoint tensor before dequantization.

    `data` is in torch row order with llama.cpp's Q/K row permutation already
    undone: `[rows, row_bytes]` uint8 for block-quantized types, `[rows, cols]`
    (or `[n]`) of the float type otherwise. `shape` is the torch shape.
    """

    hf_name: str
    gguf_name: str
    data: np.ndarray[Any, Any]
    quant: GGMLQuantizationType
    shape: tuple[int, ...]


def load_gguf(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    *,
    keep_q4: bool = False,
    q4_aside: bool = False,
) -> LoadedModel:
    """Read a `.gguf` file: config and tokenizer from its metadata, weights dequantized.

    `keep_q4`: projections whose matrices the file stores as Q4_0 / Q4_1 are kept as
    int4 with those very blocks (the caller quantizes the rest; bf16 or float32).
    `q4_aside`: the same blocks packed in `LoadedModel.q4_blocks`, the model dense."""
    file = Path(path)
    reader = open_gguf(file)
    config = gguf_config(reader, file)
    found = {t.hf_name: t.shape for t in iter_raw_tensors(reader, config)}
    check_hf_names(config, found)
    wanted = set(hf_weight_shapes(config))
    hf: dict[str, torch.Tensor] = {}
    q4: dict[str, Q4Fields] = {}
    for raw in iter_raw_tensors(reader, config):
        if raw.hf_name in wanted:
            values = dequantize_raw(raw)
            if config.gemma_norms and raw.hf_name.endswith("norm.weight"):
                values = values - 1  # llama.cpp stores Gemma's 1 + weight; HF the weight
            hf[raw.hf_name] = _place(values, dtype, device)
            if (keep_q4 or q4_aside) and raw.quant in _Q4_BLOCK_BYTES:
                q4[raw.hf_name] = q4_fields(raw)
    tokenizer = tokenizer_from_gguf(reader, file)
    loaded = build_model(config, to_model_state(config, hf), tokenizer, dtype, device)
    aside = None
    if q4 and keep_q4:
        loaded.model.quantize("int4", prepacked=fused_q4(config, q4))
    elif q4:
        aside = fused_q4(config, q4)
    return dataclasses.replace(loaded, source_quant=source_quant(reader), q4_blocks=aside)


_Q4_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}


def q4_fields(raw: RawTensor) -> Q4Fields:
    """A Q4_0 / Q4_1 matrix's blocks [rows, row_bytes] unpacked (`Q4Fields`)."""
    rows = raw.data.shape[0]
    blocks = np.ascontiguousarray(raw.data).reshape(rows, -1, _Q4_BLOCK_BYTES[raw.quant])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if raw.quant == GGMLQuantizationType.Q4_0:  # w = (q - 8) * d
        m, packed = -8.0 * d, blocks[..., 2:]
    else:  # Q4_1: w = q * d + m
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        packed = blocks[..., 4:]
    nibbles = torch.from_numpy(packed.astype(np.int32))  # [rows, blocks, 16]
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, -1)  # low nibbles first
    return Q4Fields(d, m, q)


def fused_q4(config: ModelConfig, q4: dict[str, Q4Fields]) -> dict[str, PackedWeight]:
    """The model's int4 projections (by module name) that Q4 blocks wholly cover, fused
    like the dense weights (rows [q | k | v], [gate | up])."""
    groups: dict[str, tuple[str, ...]] = {}
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        groups[f"{dst}self_attn.qkv_proj"] = (
            (f"{src}self_attn.qkv_proj",)
            if config.family == "phi3"
            else tuple(f"{src}self_attn.{n}_proj" for n in "qkv")
        )
        groups[f"{dst}self_attn.o_proj"] = (f"{src}self_attn.o_proj",)
        groups[f"{dst}mlp.gate_up_proj"] = (
            (f"{src}mlp.gate_up_proj",)
            if config.family == "phi3"
            else (f"{src}mlp.gate_proj", f"{src}mlp.up_proj")
        )
        groups[f"{dst}mlp.down_proj"] = (f"{src}mlp.down_proj",)
    head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
    groups["lm_head"] = (head,)
    packed: dict[str, PackedWeight] = {}
    for module, parts in groups.items():
        fields = [q4.get(f"{p}.weight") for p in parts]
        if all(f is not None for f in fields):
            packed[module] = Q4Fields.cat([f for f in fields if f is not None]).pack()
    return packed


def open_gguf(file: Path) -> GGUFReader:
    if not file.is_file():
        raise ModelLoadError(f"no GGUF file at {file}")
    try:
        return GGUFReader(file)
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors, ...
        if "GGMLQuantizationType" in str(e):  # a type id this gguf version does not know
            raise ModelLoadError(f"{file.name}: a tensor has an unknown ggml type: {e}") from e
        raise ModelLoadError(f"{file} is not a readable GGUF file (truncated?): {e}") from e


def gguf_config(reader: GGUFReader, file: Path) -> ModelConfig:
    """The `ModelConfig` a GGUF's metadata (`<arch>.*` keys) describes."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{file.name}: unsupported GGUF architecture {arch!r}; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}"
        )

    family = ARCHITECTURE_FAMILIES[arch]

    def key(name: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{file.name}: metadata is missing {arch}.{name}")
        return value

    for unsupported in ("rope.scaling.type",):
        kind = field_value(reader, f"{arch}.{unsupported}")
        if kind not in (None, "none"):
            raise ModelLoadError(f"{file.name}: rope scaling {kind!r} is not supported yet")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            f"{file.name}: per-frequency rope factors (rope_freqs, Llama 3.1 style) "
            "are not supported yet"
        )
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{file.name}: partial rotary embeddings ({rope_dims} of {head_dim} dims) "
            "are not supported"
        )
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        vocab = len(tokens)
    elif embd := [t for t in reader.tensors if t.name == "token_embd.weight"]:
        vocab = int(embd[0].shape[-1])  # dims fastest-first: [hidden, vocab]
    else:
        vocab = int(key("vocab_size"))
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    context = int(key("context_length", 2048))
    window = field_value(reader, f"{arch}.attention.sliding_window")
    if family == "phi3" and isinstance(window, int) and 0 < window < context:
        context = window  # as for the folder: exact only while the context fits the window
    gemma = _gemma3_fields(reader, arch, hidden, heads, head_dim) if family == "gemma3" else {}
    biased_o = "blk.0.attn_output.bias" in names
    biased_q = "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
            attention_bias=biased_o,
            mlp_bias="blk.0.ffn_down.bias" in names,
            qkv_bias=biased_q and not biased_o,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            family=family,
            **gemma,
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelConfigError):
            raise
        raise ModelLoadError(f"{file.name}: malformed metadata: {e}") from e


def _gemma3_fields(
    reader: GGUFReader, arch: str, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """Gemma 3's extra `ModelConfig` fields, as llama.cpp reads them from its files."""
    layers = int(field_value(reader, f"{arch}.block_count"))
    pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: True where it slides
        sliding = [bool(p) for p in pattern]
    else:
        every = int(pattern or _GEMMA3_SLIDING_PATTERN)
        sliding = [(i + 1) % every != 0 for i in range(layers)]
    window = field_value(reader, f"{arch}.attention.sliding_window")
    scalar = hidden // heads if layers == _GEMMA3_27B_LAYERS else head_dim
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "layer_types": tuple("sliding_attention" if s else "full_attention" for s in sliding),
        "sliding_window": None if window is None else int(window),
        "rope_local_theta": _GEMMA3_LOCAL_ROPE_THETA,
        "query_pre_attn_scalar": float(scalar),
    }


def iter_raw_tensors(reader: GGUFReader, config: ModelConfig) -> Iterator[RawTensor]:
    """Every tensor with its Hugging Face name, raw (still quantized), in file order.

    Unknown tensor names are yielded under their GGUF name so the name check
    reports them. Q/K rows come back in Hugging Face order: permuting whole
    rows commutes with ggml's row-wise block quantization.
    """
    permuted = config.family in _PERMUTED_QK
    for t in reader.tensors:
        hf_name = hf_name_of(t.name, config.family)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data: np.ndarray[Any, Any] = t.data
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_rows(data, config.num_heads)
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_rows(data, config.num_kv_heads)
        yield RawTensor(hf_name, t.name, data, GGMLQuantizationType(t.tensor_type), shape)


def hf_name_of(gguf_name: str, family: str = "llama") -> str:
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        module = _FAMILY_BLOCK_NAMES.get(family, {}).get(part) or _BLOCK_NAMES.get(part)
        if module is not None:
            return f"model.layers.{layer}.{module}.{kind}"
    elif (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return gguf_name


def unpermute_rows(data: np.ndarray[Any, Any], n_head: int) -> np.ndarray[Any, Any]:
    """Undo convert_hf_to_gguf.py's `permute` of q_proj/k_proj rows.

    llama.cpp stores each head's rotary pairs interleaved (rows of a head as
    `[half, 2]`, GPT-J style) where Hugging Face keeps the two halves apart
    (`[2, half]`, NeoX style). data: [n_head * head_dim, ...] -> same shape.
    """
    rows = data.shape[0]
    half = rows // n_head // 2
    w = data.reshape(n_head, half, 2, *data.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(data.shape))


def permute_rows(data: np.ndarray[Any, Any], n_head: int) -> np.ndarray[Any, Any]:
    """convert_hf_to_gguf.py's `permute` (Hugging Face -> llama.cpp row order)."""
    rows = data.shape[0]
    half = rows // n_head // 2
    w = data.reshape(n_head, 2, half, *data.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(data.shape))


def dequantize_raw(raw: RawTensor) -> torch.Tensor:
    """float32 tensor of `raw.shape` (BF16 and F16 widen exactly)."""
    try:
        values = dequantize(raw.data, raw.quant)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"tensor {raw.gguf_name} has ggml type {raw.quant.name}, which cannot be "
            f"dequantized: {e}"
        ) from e
    values = np.asarray(values, dtype=np.float32)
    if not values.flags.writeable:  # a view of the read-only memory map (F32)
        values = values.copy()
    if tuple(values.shape) != raw.shape:
        try:
            values = values.reshape(raw.shape)
        except ValueError as e:
            raise ModelLoadError(
                f"tensor {raw.gguf_name}: {values.size} values do not fill shape {raw.shape}"
            ) from e
    return torch.from_numpy(values)


def source_quant(reader: GGUFReader) -> str | None:
    """The most common ggml type among the file's matrices, e.g. "Q4_1" (norms are
    usually F32 whatever the file's quantization)."""
    counts = Counter(
        GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) >= 2
    )
    return counts.most_common(1)[0][0] if counts else None


def _place(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype)
