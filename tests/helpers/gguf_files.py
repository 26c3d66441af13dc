"""Write random transformers checkpoints as GGUF files, the way llama.cpp's converter does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import LlamaForCausalLM

from tokenfleet.model.gguf import permute_rows

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32

# transformers model_type -> llama.cpp architecture (Mistral is converted as Llama)
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3_text": "gemma3",
}

# Hugging Face module -> GGUF tensor (the inverse of tokenfleet.model.gguf's mapping).
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up fused in one tensor
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Gemma's four layer norms (its post_attention_layernorm normalises the attention output)
_GEMMA3_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        names = {**_HF_TO_GGUF, **_GEMMA3_NORMS} if arch == "gemma3" else _HF_TO_GGUF
        return f"blk.{layer}.{names[module]}.{kind}"
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, kind = hf_name.rsplit(".", 1)
    return f"{top[module]}.{kind}"


def round_trip(t: torch.Tensor, quant: gguf.GGMLQuantizationType) -> torch.Tensor:
    """What a tensor becomes after ggml quantization and back (matrices only)."""
    if quant == F32 or t.dim() < 2:
        return t
    data = gguf.quants.quantize(t.numpy(), quant)
    return torch.from_numpy(gguf.quants.dequantize(data, quant).copy())


def round_trip_model(model: LlamaForCausalLM, quant: gguf.GGMLQuantizationType) -> None:
    """Replace every matrix of `model` in place by its quantized-and-back value."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(round_trip(p.detach(), quant))


def write_gguf(
    hf: LlamaForCausalLM,
    path: Path,
    quant: gguf.GGMLQuantizationType,
    *,
    arch: str | None = None,
    tokenizer_model: str | None = None,
) -> Path:
    """Write `hf` as llama.cpp's convert_hf_to_gguf.py would: Q/K rows permuted for
    Llama, Gemma's norm weights stored as 1 + weight, matrices in `quant` (norms and
    biases stay F32)."""
    c = hf.config
    arch = arch or GGUF_ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    add_model_metadata(w, c)
    window = getattr(c, "sliding_window", None)
    if c.model_type == "phi3" and window:
        w.add_sliding_window(window)
    if arch == "gemma3":
        w.add_sliding_window(window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if tokenizer_model is not None:
        w.add_tokenizer_model(tokenizer_model)
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    permute = arch == "llama"
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy()
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = permute_rows(arr, c.num_attention_heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            # transformers sets num_key_value_heads (None in a config = num_attention_heads)
            arr = permute_rows(arr, c.num_key_value_heads or c.num_attention_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1
        if quant != F32 and arr.ndim >= 2:
            w.add_tensor(gguf_name(name, arch), gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name(name, arch), np.ascontiguousarray(arr))
    return finish_gguf(w, path)


def add_model_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """The `<arch>.*` shape keys of a transformers config `c`."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    w.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    w.add_vocab_size(c.vocab_size)


def finish_gguf(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
