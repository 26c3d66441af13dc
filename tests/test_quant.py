"""Weights kept quantized (int8 per channel, int4 in groups of 32), `--dtype auto`, and
the compiled forward: each path within its tolerance of the dense one."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.helpers.models import block_tables, make_hf_llama, save_hf_llama
from tests.test_gguf import SMOLLM2, needs_smollm2
from tokenfleet.model import LoadedModel, ModelLoadError, SeqInput, load_model
from tokenfleet.model.loader import cpu_has_bf16, resolve_dtype
from tokenfleet.model.quant import (
    INT4_GROUP,
    QuantError,
    QuantLinear,
    from_q4_blocks,
    quantize,
    quantize_int4,
    quantize_int8,
)

pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch without int4 CPU"
)


def test_int8_holds_each_row_to_half_a_step() -> None:
    w = torch.randn(64, 96) * torch.linspace(0.1, 3.0, 64)[:, None]  # rows of different range
    p = quantize_int8(w)
    assert p.data.dtype == torch.int8 and p.scales.shape == (64,)
    step = p.scales.float()[:, None]
    assert bool(((p.dequantize() - w).abs() <= step * 0.5 + 1e-6).all())
    # torch's layout keeps bf16 scales, tokenfleet's kernel float32 ones (rows16)
    assert p.nbytes == 64 * 96 + 64 * (4 if p.rows16 else 2)


def test_int4_holds_each_group_to_half_a_step() -> None:
    w = torch.randn(48, 128) + torch.linspace(-2, 2, 128)  # groups with offsets
    p = quantize_int4(w)
    back = p.dequantize()
    g = w.view(48, -1, INT4_GROUP)
    step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(INT4_GROUP, dim=1)  # [out, in]
    # half a step, plus the rounding of the scales (bf16 or float16, by layout) and, in
    # torch's layout, of the value read back through its kernel
    slack = (g.amin(-1).abs().repeat_interleave(INT4_GROUP, dim=1) + w.abs()) * 2**-7 + 1e-6
    assert bool(((back - w).abs() <= step * 0.5 + slack).all())
    with pytest.raises(QuantError, match="divisible by 32"):
        quantize_int4(torch.randn(8, 40))


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_packed_matmul_is_the_dequantized_matmul(kind: str, rows: int) -> None:
    w = torch.randn(80, 64)
    p = quantize(w, kind)  # type: ignore[arg-type]
    x = torch.randn(rows, 64).bfloat16()
    ref = x.float() @ p.dequantize().t()
    torch.testing.assert_close(p.matmul(x).float(), ref, atol=0.05 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("q4", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_llama_cpp_q4_blocks_are_taken_as_they_are(q4: gguf.GGMLQuantizationType) -> None:
    w = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(w, q4)  # [16, 2 * bytes per block]
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, q4).copy())
    size = gguf.GGML_QUANT_SIZES[q4][1]
    raw = blocks.reshape(16, 2, size)
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    has_min = q4 == gguf.GGMLQuantizationType.Q4_1
    m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    qs = torch.from_numpy(raw[..., 4 if has_min else 2 :].astype(np.int32))  # [16, 2, 16]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(16, 64)  # low nibbles first
    p = from_q4_blocks(d, m if has_min else None, q)
    # exact but for the bf16 rounding of scale and zero
    torch.testing.assert_close(p.dequantize(), ref, atol=0.02 * float(ref.abs().max()), rtol=0)


# ---- whole models ---------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    hf = make_hf_llama(seed=9, hidden_size=128, intermediate_size=256, num_attention_heads=4)
    return str(save_hf_llama(hf, tmp_path_factory.mktemp("quant")))


def _logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    pool = loaded.model.new_kv_pool(8, 16)
    (table,) = block_tables([len(prompt)], 16, 8)
    return loaded.model.forward(prompt, [SeqInput(table, 0, len(prompt))], pool)[0]


@pytest.mark.parametrize(("kind", "min_cos"), [("int8", 0.999), ("int4", 0.98)])
def test_a_quantized_model_stays_close_to_its_bf16_self(
    folder: str, kind: str, min_cos: float
) -> None:
    dense = load_model(folder, dtype="bfloat16", device="cpu")
    packed = load_model(folder, dtype="auto", device="cpu", quant=kind)
    # auto: bf16 where the CPU computes it, else float32 (the packed kernels take either)
    assert packed.quant == kind
    assert packed.dtype == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    assert packed.weight_bytes < dense.weight_bytes
    prompt = [5, 77, 300, 12, 401, 9, 250, 33, 100, 7]
    a, b = _logits(dense, prompt), _logits(packed, prompt)
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) >= min_cos


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_row_in_a_quantized_batch_is_the_row_alone(folder: str, kind: str) -> None:
    """Batching never mixes sessions: row 0 of an 8-row decode is that session decoded
    alone (to bf16 noise: the kernel's blocking depends on the row count), and no other
    row is. Prompts of 5-26 tokens go through both kernel paths (<= 16 rows packed,
    longer chunks dequantized)."""
    packed = load_model(folder, dtype="bfloat16", device="cpu", quant=kind).model
    pool = packed.new_kv_pool(16, 16)
    prompts = [[(3 * i + 7 * k) % 500 + 1 for k in range(5 + 3 * i)] for i in range(8)]
    seqs = [SeqInput([2 * i, 2 * i + 1], 0, len(p)) for i, p in enumerate(prompts)]
    packed.forward([t for p in prompts for t in p], seqs, pool)
    steps = [SeqInput([2 * i, 2 * i + 1], len(p), 1) for i, p in enumerate(prompts)]
    together = packed.forward([9] * 8, steps, pool)
    alone = packed.forward([9], steps[:1], pool)
    cos = torch.nn.functional.cosine_similarity
    assert float(cos(together[0], alone[0], dim=0)) >= 0.999
    assert float(cos(together[1], alone[0], dim=0)) < 0.99


@pytest.mark.parametrize(("kind", "min_cos"), [("int8", 0.999), ("int4", 0.98)])
def test_a_quantized_float32_model_stays_close_to_its_float32_self(
    folder: str, kind: str, min_cos: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--quant` on a CPU without bf16 (`--dtype auto` there is float32): the packed
    weights with float32 activations, prefill (a 10-token chunk) and decode alike, stay
    as close to the dense float32 model as the bf16 pair does; no bf16 model is loaded."""
    import tokenfleet.model.loader as loader

    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    dense = load_model(folder, dtype="float32", device="cpu")
    packed = load_model(folder, dtype="auto", device="cpu", quant=kind)
    assert packed.quant == kind and packed.dtype == torch.float32
    prompt = [5, 77, 300, 12, 401, 9, 250, 33, 100, 7]
    a, b = _logits(dense, prompt), _logits(packed, prompt)
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) >= min_cos
    pools = [m.model.new_kv_pool(8, 16) for m in (dense, packed)]
    (table,) = block_tables([len(prompt) + 1], 16, 8)
    for m, pool in zip((dense, packed), pools, strict=True):
        m.model.forward(prompt, [SeqInput(table, 0, len(prompt))], pool)
    step = [SeqInput(table, len(prompt), 1)]
    models = zip((dense, packed), pools, strict=True)
    a, b = (m.model.forward([42], step, pool)[0] for m, pool in models)
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) >= min_cos


def test_bad_combinations_are_named(folder: str) -> None:
    with pytest.raises(ModelLoadError, match="bfloat16 or float32 activations"):
        load_model(folder, dtype="float16", device="cpu", quant="int8")
    with pytest.raises(ModelLoadError, match="unsupported quant 'int3'"):
        load_model(folder, device="cpu", quant="int3")


def test_auto_dtype_follows_the_cpu() -> None:
    want = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == want
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="'auto', 'bf16'"):
        resolve_dtype("int3")


# ---- the trained model: agreement with fp32, token by token -----------------------


# Three chat questions, fp32's greedy answer of 96 tokens to each, teacher-forced. One
# answer of 48 tokens (this test's first form) was too small a sample: on 2026-12-04 two
# int8 kernels that differ only in their float32 summation order read 43 and 45 of 48 on
# the Xeon AMX, while both read 0.90 on the third question here (EPYC Zen 4); over the
# 288 tokens they read 0.93 and 0.94, and the mean KL divergence says more than top-1.
QUESTIONS = (
    "What is the capital of France, and why is it famous?",
    "Explain how a bicycle works.",
    "Write a short poem about the sea.",
)
ANSWER_TOKENS = 96


@pytest.fixture(scope="module")
def fp32_answers() -> list[tuple[list[int], torch.Tensor, int]]:
    """For each question: prompt + SmolLM2 fp32's greedy answer, fp32's log-probabilities
    at every position, and the prompt's length."""
    assert SMOLLM2 is not None
    ref = load_model(str(SMOLLM2), dtype="float32", device="cpu")
    tok = ref.tokenizer
    assert tok is not None
    out = []
    for question in QUESTIONS:
        prompt = tok.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        text = prompt + _greedy(ref, prompt, ANSWER_TOKENS)
        out.append((text, _all_logits(ref, text).log_softmax(-1), len(prompt)))
    return out


@needs_smollm2
@pytest.mark.parametrize(
    ("variant", "min_agree", "max_kl"),
    # measured 2026-12-04 on an EPYC Zen 4 (agreement, mean KL per answer): bf16 0.975,
    # 0.0009-0.0010; int8 0.93, 0.0055-0.0080 (the int8 kernel before, 0.94,
    # 0.0063-0.0091); int4 (the file's Q4_1 blocks) 0.93, 0.0046-0.0051
    [("bf16", 0.9, 0.004), ("int8", 0.9, 0.02), ("int4", 0.8, 0.02)],
)
def test_smollm2_variants_agree_with_fp32_token_by_token(
    fp32_answers: list[tuple[list[int], torch.Tensor, int]],
    variant: str,
    min_agree: float,
    max_kl: float,
) -> None:
    """Teacher-forced on fp32's own greedy answers: how often each variant's top-1 is
    fp32's next token (a 135M model's margins are thin, so bf16 itself is not 1.0), and
    how far its next-token distribution is from fp32's (KL(fp32 || variant), the mean
    per token of each answer)."""
    assert SMOLLM2 is not None
    quant = None if variant == "bf16" else variant
    other = load_model(str(SMOLLM2), dtype="bfloat16", device="cpu", quant=quant)
    agreed, total, kls = 0, 0, []
    for text, ref_logp, n_prompt in fp32_answers:
        span = slice(n_prompt - 1, len(text) - 1)
        logp = _all_logits(other, text).float().log_softmax(-1)[span]
        ref = ref_logp[span]
        agreed += int((ref.argmax(-1) == logp.argmax(-1)).sum())
        total += ref.shape[0]
        kls.append(float((ref.exp() * (ref - logp)).sum(-1).mean()))
    agree = agreed / total
    assert agree >= min_agree, f"{variant}: {agree:.3f} of the answers' tokens agree with fp32"
    assert max(kls) <= max_kl, f"{variant}: mean KL from fp32, per answer: {kls}"


def _greedy(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    pool = loaded.model.new_kv_pool(16, 16)
    out: list[int] = []
    step, pos = prompt, 0
    for _ in range(n):
        logits = loaded.model.forward(step, [SeqInput(list(range(16)), pos, len(step))], pool)
        pos += len(step)
        out.append(int(logits[0].argmax()))
        step = out[-1:]
    return out


def _all_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position: one token per forward (teacher forcing)."""
    pool = loaded.model.new_kv_pool(16, 16)
    rows = [
        loaded.model.forward([t], [SeqInput(list(range(16)), i, 1)], pool)[0]
        for i, t in enumerate(ids)
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("q4", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_int4_from_a_q4_gguf_keeps_the_files_blocks(
    q4: gguf.GGMLQuantizationType, tmp_path: Path
) -> None:
    """`--quant int4` on a Q4_0 / Q4_1 file serves the file's own 4-bit values (not a
    requantization of them): every projection equals the file's dequantized matrix to
    bf16 rounding, and a requantized one does not."""
    from tests.helpers.gguf_files import write_gguf

    hf = make_hf_llama(seed=2, hidden_size=128, intermediate_size=256, num_attention_heads=4)
    path = write_gguf(hf, tmp_path / "m.gguf", q4)
    kept = load_model(str(path), dtype="auto", device="cpu", quant="int4")
    dense = load_model(str(path), dtype="float32", device="cpu")  # the file, dequantized
    assert kept.source_quant == q4.name and kept.quant == "int4"
    layer = kept.model.blocks[0]
    ref_layer = dense.model.blocks[0]
    for mine, ref in [
        (layer.self_attn.qkv_proj, ref_layer.self_attn.qkv_proj),
        (layer.mlp.down_proj, ref_layer.mlp.down_proj),
    ]:
        assert isinstance(mine, QuantLinear)
        w = ref.weight.detach()
        err = (mine.packed.dequantize() - w).abs().max()
        assert float(err) <= 0.01 * float(w.abs().max())
        requantized = quantize_int4(w).dequantize()
        assert float((requantized - w).abs().max()) > float(err)
