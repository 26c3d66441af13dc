"""Hugging Face Llama-family weight names, and their mapping onto this package's fused layout.

The checkpoint stores q/k/v and gate/up projections separately; the model keeps
each group as one matrix (rows [q | k | v] and [gate | up]) so a layer does two
fewer matmuls per projection group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from tokenfleet.errors import ModelLoadError
from tokenfleet.model.config import ModelConfig

# Non-weight tensors older checkpoints carry; recomputed by the model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config holds, in a fixed order."""
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = {"q_proj": (q_out, h), "k_proj": (kv_out, h), "v_proj": (kv_out, h)}
        if config.family == "phi3":  # stored fused, rows [q | k | v]
            attn = {"qkv_proj": (q_out + 2 * kv_out, h)}
        attn["o_proj"] = (h, q_out)
        for name, shape in attn.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            biased = config.attention_bias if name == "o_proj" else config.has_qkv_bias
            if biased:
                shapes[f"{p}self_attn.{name}.bias"] = shape[:1]
        if config.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}self_attn.k_norm.weight"] = (hd,)
        mlp = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
        if config.family == "phi3":  # stored fused, rows [gate | up]
            mlp = {"gate_up_proj": (2 * inter, h), "down_proj": (h, inter)}
        for name, shape in mlp.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = shape[:1]
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
        if config.gemma_norms:
            shapes[f"{p}pre_feedforward_layernorm.weight"] = (h,)
            shapes[f"{p}post_feedforward_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_hf_names(config: ModelConfig, found: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ModelLoadError naming what is missing, unexpected or mis-shaped."""
    expected = hf_weight_shapes(config)
    names = {n for n in found if not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        names.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint does not match a {config.family} config: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}"
        )
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise ModelLoadError(f"{name} has shape {tuple(found[name])}, config implies {shape}")


def to_model_state(config: ModelConfig, hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Map checkpoint tensors (already in the target dtype/device) to `LlamaModel` names."""
    state = {"embed_tokens.weight": hf["model.embed_tokens.weight"]}
    kinds = ("weight", "bias") if config.has_qkv_bias else ("weight",)
    o_kinds = ("weight", "bias") if config.attention_bias else ("weight",)
    mlp_kinds = ("weight", "bias") if config.mlp_bias else ("weight",)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for kind in kinds:
            state[f"{dst}self_attn.qkv_proj.{kind}"] = _fused(hf, f"{src}self_attn.", "qkv", kind)
        for kind in o_kinds:
            state[f"{dst}self_attn.o_proj.{kind}"] = hf[f"{src}self_attn.o_proj.{kind}"]
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                state[f"{dst}self_attn.{norm}.weight"] = hf[f"{src}self_attn.{norm}.weight"]
        for kind in mlp_kinds:
            state[f"{dst}mlp.gate_up_proj.{kind}"] = _fused(hf, f"{src}mlp.", "gate_up", kind)
            state[f"{dst}mlp.down_proj.{kind}"] = hf[f"{src}mlp.down_proj.{kind}"]
        for ours, theirs in _layer_norms(config):
            state[f"{dst}{ours}.weight"] = hf[f"{src}{theirs}.weight"]
    state["norm.weight"] = hf["model.norm.weight"]
    if config.gemma_norms:  # Gemma's norms scale by (1 + weight): keep the sum
        for name in [n for n in state if n.endswith("norm.weight")]:
            state[name] = state[name] + 1
    state["lm_head.weight"] = (
        state["embed_tokens.weight"] if config.tie_word_embeddings else hf["lm_head.weight"]
    )
    return state


def _layer_norms(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """(model name, checkpoint name) of each layer norm. `post_attention_layernorm` is
    the MLP's input norm in the model; Gemma's checkpoints call that one
    `pre_feedforward_layernorm`, and theirs normalises the attention's output."""
    if not config.gemma_norms:
        return (
            ("input_layernorm", "input_layernorm"),
            ("post_attention_layernorm", "post_attention_layernorm"),
        )
    return (
        ("input_layernorm", "input_layernorm"),
        ("post_attention_layernorm", "pre_feedforward_layernorm"),
        ("attn_out_norm", "post_attention_layernorm"),
        ("mlp_out_norm", "post_feedforward_layernorm"),
    )


def _fused(hf: Mapping[str, Tensor], prefix: str, group: str, kind: str) -> Tensor:
    """`group`'s rows as one matrix: taken as is where the checkpoint stores it fused
    (phi3), else concatenated from its parts (q, k, v or gate, up)."""
    fused = hf.get(f"{prefix}{group}_proj.{kind}")
    if fused is not None:
        return fused
    parts = ("q", "k", "v") if group == "qkv" else ("gate", "up")
    return torch.cat([hf[f"{prefix}{n}_proj.{kind}"] for n in parts], dim=0)


def _few(names: list[str]) -> str:
    if not names:
        return "nothing"
    shown = ", ".join(names[:5])
    return f"{shown} (+{len(names) - 5} more)" if len(names) > 5 else shown
