"""Every ggml weight type the loader promises: a GGUF whose matrices are F16, BF16,
Q4_0 ... Q8_0 or a K-quant loads, dequantizes, and runs like transformers on the
same dequantized weights."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from tests.helpers.gguf_files import add_model_metadata, finish_gguf, gguf_name
from tests.helpers.models import make_hf_llama, reference_logits
from tests.test_gguf import greedy, prefill_logits
from tokenfleet.model import ModelLoadError, load_model
from tokenfleet.model.gguf import permute_rows, unpermute_rows

Q = gguf.GGMLQuantizationType
# The types gguf's numpy code can also write (quantize) ...
WRITABLE = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# ... and the K-quants it can only read: their blocks are filled with random bytes
# (kept below 0x20 so every fp16 scale inside a block is small and finite).
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]

# Every matrix's rows are 256 wide (a K-quant block is 256 values).
SHAPE: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=256,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
PROMPT = [5, 77, 300, 12, 101, 9, 250, 33]


def _encode(arr: np.ndarray[Any, Any], quant: Q, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    if quant in WRITABLE:
        return gguf.quants.quantize(arr, quant)
    block, type_size = gguf.GGML_QUANT_SIZES[quant]
    rows, cols = arr.shape
    return rng.integers(0, 0x20, size=(rows, cols // block * type_size), dtype=np.uint8)


def write_quantized(hf: LlamaForCausalLM, path: Path, quant: Q) -> LlamaForCausalLM:
    """Write `hf` with every matrix in `quant`; set `hf`'s weights to what the file
    holds once dequantized, so it becomes the reference."""
    c, rng = hf.config, np.random.default_rng(int(quant))
    w = gguf.GGUFWriter(str(path), "llama")
    add_model_metadata(w, c)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            arr = p.detach().numpy()
            heads = (
                c.num_attention_heads
                if "q_proj" in name
                else c.num_key_value_heads
                if "k_proj" in name
                else 0
            )
            if heads:
                arr = permute_rows(arr, heads)
            if arr.ndim < 2:
                w.add_tensor(gguf_name(name), np.ascontiguousarray(arr))
                continue
            data = _encode(arr, quant, rng)
            w.add_tensor(gguf_name(name), data, raw_dtype=quant)
            back = np.asarray(gguf.quants.dequantize(data, quant), dtype=np.float32)
            assert back.shape == arr.shape and np.isfinite(back).all()
            if heads:
                back = unpermute_rows(back, heads)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    finish_gguf(w, path)
    return hf


@pytest.mark.parametrize("quant", WRITABLE + K_QUANTS, ids=lambda q: q.name)
def test_quantized_gguf_runs_like_transformers_on_its_weights(quant: Q, tmp_path: Path) -> None:
    hf = write_quantized(make_hf_llama(seed=11, **SHAPE), tmp_path / "m.gguf", quant)
    loaded = load_model(str(tmp_path / "m.gguf"), device="cpu")
    assert loaded.source_quant == quant.name
    assert loaded.weight_bytes == loaded.config.param_count * 4  # served as float32
    ref = reference_logits(hf, PROMPT)[-1]
    ours = prefill_logits(loaded, PROMPT)
    scale = max(float(ref.abs().max()), 1.0)
    torch.testing.assert_close(ours, ref, atol=1e-4 * scale, rtol=0)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert greedy(loaded, PROMPT, 8) == out[0, len(PROMPT) :].tolist()


def _with_tensor_type(path: Path, tensor: str, type_id: int) -> Path:
    """Rewrite the ggml type id in `tensor`'s header entry (name, n_dims, dims, type)."""
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    out = path.with_name(f"type{type_id}.gguf")
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(
    ("type_id", "message"),
    [
        (99, r"unknown ggml type.*99"),  # no such type
        (int(Q.Q8_1), r"token_embd\.weight has ggml type Q8_1, which cannot be dequantized"),
    ],
)
def test_an_unsupported_tensor_type_is_named(type_id: int, message: str, tmp_path: Path) -> None:
    # F16 matrices: 2 bytes a value, more than Q8_1's 36 bytes per 32 values need
    write_quantized(make_hf_llama(seed=11, **SHAPE), tmp_path / "m.gguf", Q.F16)
    bad = _with_tensor_type(tmp_path / "m.gguf", "token_embd.weight", type_id)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(bad), device="cpu")
