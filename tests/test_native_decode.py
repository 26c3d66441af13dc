"""The native decode stack (tokenfleet/model/native_decode.py, `DecodeStack` in
attention/paged_cpu.cpp): whole decode ticks in one C++ call, against the eager forward
it copies op by op, for every weight kind it runs and every family's layers; the models
it does not serve keep the compiled decode graph, and the worker's hash says which runs."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.models import REFERENCE_CONFIGS, make_hf_llama, save_hf_llama
from tokenfleet.model import load_model, quant
from tokenfleet.model.attention import paged_cpu
from tokenfleet.model.compiled import compile_model
from tokenfleet.model.config import FULL, SLIDING
from tokenfleet.model.llama import LlamaModel
from tokenfleet.model.native_decode import NativeDecode, unsupported
from tokenfleet.model.tick_inputs import SeqInput

needs_kernel = pytest.mark.skipif(not paged_cpu.load(), reason=f"{paged_cpu.failure()}")
needs_vnni = pytest.mark.skipif(
    not quant.int_kernels(), reason="the packed kernels need AVX2 or AVX512-VNNI"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small Llama whose every matrix the packed 16-row layouts hold (dims multiples
    of 32; tiny-random's 688-wide MLP is not: its down projection stays in torch's
    layout, which the stack does not run)."""
    hf = make_hf_llama(
        hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1
    )
    return str(save_hf_llama(hf, tmp_path_factory.mktemp("native") / "llama"))


def _tiny(
    checkpoint: str, weights: str, dtype: str = "bfloat16", kv: str | None = None
) -> LlamaModel:
    """The checkpoint in bf16 (or float32: a default start on a CPU without bf16) with the
    weight set a worker would decode on: the dense one, a narrow int8 or int4 set beside
    it (the default start), or all int8 (`--quant`); `kv` "float16": K/V kept in float16
    (a float32 model's default start)."""
    model = load_model(checkpoint, dtype=dtype, device="cpu").model
    if kv is not None:
        model.set_kv_dtype(getattr(torch, kv))
    if weights in ("int8", "int4"):
        model.add_narrow(weights, 8)
    elif weights == "quantized":
        model.quantize("int8")
    return model


def _prefill(model: LlamaModel, rows: int, length: int, blocks: int = 8) -> tuple:
    """A pool holding `rows` prompts of `length` tokens, each in its own shuffled
    blocks of 4; returns (pool, tables)."""
    pool = model.new_kv_pool(rows * blocks + 2, 4)
    order = torch.randperm(rows * blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [order[r * blocks : (r + 1) * blocks] for r in range(rows)]
    for r in range(rows):
        ids = [(7 * r + 3 * i) % 500 + 1 for i in range(length)]
        model.forward(ids, [SeqInput(tables[r], 0, length)], pool)
    return pool, tables


@needs_kernel
@pytest.mark.parametrize(
    ("weights", "dtype", "kv"),
    [
        ("dense", "bfloat16", None),
        pytest.param("int8", "bfloat16", None, marks=needs_vnni),
        pytest.param("int4", "bfloat16", None, marks=needs_vnni),
        pytest.param("quantized", "bfloat16", None, marks=needs_vnni),  # --quant
        ("dense", "float32", None),
        pytest.param("quantized", "float32", None, marks=needs_vnni),  # --quant without bf16
        pytest.param("int8", "float32", None, marks=needs_vnni),
        pytest.param("int4", "float32", None, marks=needs_vnni),
        ("dense", "float32", "float16"),  # a float32 model's K/V in float16
        pytest.param("int4", "float32", "float16", marks=needs_vnni),  # its default start
    ],
)
def test_the_stack_follows_the_eager_forward_step_by_step(
    weights: str, dtype: str, kv: str | None, checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy decoding of three rows for 14 steps (across block edges): the stack's
    logits are the eager forward's with the same attention kernel, up to the order of a
    norm's sum (a last bf16 bit now and then); the same greedy tokens; the same K/V in
    the pool. A float32 model keeps float32 between ops, as its eager forward does, and
    with a float16 pool both round each new key and value to float16 as they write it."""
    monkeypatch.setenv("TOKENFLEET_PAGED_ATTENTION", "1")  # eager attends with the kernel
    model = _tiny(checkpoint, weights, dtype, kv)
    _follows_eager(model, narrow=weights in ("int8", "int4"))


def _follows_eager(model: LlamaModel, narrow: bool, kv_exact: bool = True, rows: int = 3) -> None:
    """`rows` rows decoded greedily for 14 steps (positions 5..18: across block edges,
    past an 8-token window) by the stack and by the eager forward, each on its own copy
    of one pool: the same logits up to a last bf16 bit now and then, the same greedy
    tokens, the same K/V."""
    stack = NativeDecode(model, narrow=narrow)
    pool, tables = _prefill(model, rows, 5)
    eager_pool = copy.deepcopy(pool)
    fed = [[11 + r] for r in range(rows)]
    agree = 0
    for step in range(14):
        seqs = [SeqInput(tables[r], 5 + step, 1) for r in range(rows)]
        assert stack.serves(seqs, model.is_narrow(rows, seqs))
        ids = [f[-1] for f in fed]
        got = stack.forward(ids, seqs, pool)
        want = model.forward(ids, seqs, eager_pool)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0.03, rtol=0.03)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        for r in range(rows):
            fed[r].append(int(want[r].argmax()))
    assert agree >= 14 * rows - 2  # a near tie may go either way
    for got_kv, want_kv in ((pool.k, eager_pool.k), (pool.v, eager_pool.v)):
        if kv_exact:
            torch.testing.assert_close(got_kv.float(), want_kv.float(), atol=0.02, rtol=0.02)
        else:
            _mostly_close(got_kv.float(), want_kv.float())


def _mostly_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """K/V written by the stack and by the eager forward: within 0.02 but for a few
    values (at most 0.5%, none past 0.1). Where a matmul quantizes its activations to
    int8 (the packed kernels), a last-bit difference upstream (a norm's sum order) can
    move one activation a quantization step, and that step shows in the values after."""
    off = (got - want).abs() > 0.02 + 0.02 * want.abs()
    assert float(off.float().mean()) <= 0.005, f"{int(off.sum())} of {off.numel()} values differ"
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch on two threads for the test (the matmuls split a tick's outputs between
    them, attention its rows' heads), the count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize(
    ("weights", "dtype"),
    [("dense", "bfloat16"), pytest.param("int4", "float32", marks=needs_vnni)],
)
def test_a_tick_of_six_rows_on_two_threads_follows_eager_too(
    weights: str, dtype: str, checkpoint: str, monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    """Six rows a tick on two threads (the 4-row matmul tiles and the 1- and 2-row ones,
    attention's jobs shared out): the stack still follows the eager forward."""
    monkeypatch.setenv("TOKENFLEET_PAGED_ATTENTION", "1")
    _follows_eager(_tiny(checkpoint, weights, dtype), narrow=weights == "int4", rows=6)


@needs_vnni
@pytest.mark.parametrize("rows", [3, 6])
def test_a_rows_result_does_not_depend_on_the_other_rows(
    checkpoint: str, rows: int, two_threads: None
) -> None:
    """The stack is row-wise but for attention, which reads each row's own context: a
    row's logits and K/V in a tick of three or six rows (on two threads: a 4-row matmul
    tile and a 2-row one) equal what it gets alone, bit for bit."""
    model = _tiny(checkpoint, "int4")
    stack = NativeDecode(model, narrow=True)
    pool, tables = _prefill(model, rows, 9)
    seqs = [SeqInput(tables[r], 9, 1) for r in range(rows)]
    together_pool = copy.deepcopy(pool)
    together = stack.forward([5 + r for r in range(rows)], seqs, together_pool)
    for r in range(rows):
        alone_pool = copy.deepcopy(pool)
        alone = stack.forward([5 + r], [seqs[r]], alone_pool)
        assert torch.equal(alone[0], together[r])
        assert torch.equal(alone_pool.k[:, tables[r]], together_pool.k[:, tables[r]])
        assert torch.equal(alone_pool.v[:, tables[r]], together_pool.v[:, tables[r]])


@needs_kernel
def test_sliding_window_layers_attend_within_their_window(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint's weights in a model whose first layer slides over 8 positions
    with its own rope base (Gemma 3's layout, without Gemma's norms): the stack follows
    the eager forward past the window, and differs from the same weights without it."""
    monkeypatch.setenv("TOKENFLEET_PAGED_ATTENTION", "1")
    plain = load_model(checkpoint, dtype="bfloat16", device="cpu").model
    config = dataclasses.replace(
        plain.config,
        layer_types=(SLIDING, FULL),
        sliding_window=8,
        rope_local_theta=1000.0,
    )
    model = LlamaModel(config)
    model.load_state_dict(plain.state_dict())
    model.to(torch.bfloat16)
    assert model.config.window_of(0) == 8 and unsupported(model, False) is None
    stack, without = NativeDecode(model, narrow=False), NativeDecode(plain, narrow=False)
    pool, tables = _prefill(model, 2, 20)
    eager_pool = copy.deepcopy(pool)
    for step in range(4):
        seqs = [SeqInput(tables[r], 20 + step, 1) for r in range(2)]
        unwindowed = without.forward([3, 4], seqs, copy.deepcopy(pool))
        got = stack.forward([3, 4], seqs, pool)
        want = model.forward([3, 4], seqs, eager_pool)
        torch.testing.assert_close(got, want, atol=0.03, rtol=0.03)
        assert (got - unwindowed).abs().max() > 0.1


# Families whose layers add to Llama's, in the reference tests' shapes (dims multiples
# of 32, so the 16-row layouts hold every matrix): Qwen2's q/k/v biases, Qwen3's q/k
# norms, Gemma 3's float32-scaled norms (q/k, and after attention and the MLP), query
# scale apart from head_dim, GeGLU, and windows of 8 with their own rope base.
_FAMILIES = {
    family: {**REFERENCE_CONFIGS[shape], "intermediate_size": 256}
    for family, shape in (
        ("qwen2", "qwen2-gqa"),
        ("qwen3", "qwen3-gqa"),
        ("gemma3", "gemma3-window"),
        ("mistral", "mistral-window"),  # every layer a window of 8
    )
}


@needs_kernel
@pytest.mark.parametrize(
    "weights",
    ["dense", pytest.param("int4", marks=needs_vnni), pytest.param("int8", marks=needs_vnni)],
)
@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_the_stack_serves_every_family(
    family: str, weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Biases, q/k norms and Gemma 3's norms, query scale and windows run in the stack:
    it takes the model and follows its eager forward step by step."""
    monkeypatch.setenv("TOKENFLEET_PAGED_ATTENTION", "1")
    hf = make_hf_llama(**_FAMILIES[family])
    model = load_model(str(save_hf_llama(hf, tmp_path / "m")), dtype="bfloat16", device="cpu").model
    narrow = weights != "dense"
    if narrow:
        model.add_narrow(weights, 4)
    assert unsupported(model, narrow) is None
    # Gemma 3's packed sets move a value a quantization step now and then (_mostly_close)
    _follows_eager(model, narrow, kv_exact=not (narrow and family == "gemma3"))


@needs_kernel
@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_without_each_familys_extra_the_stack_differs(family: str, tmp_path: Path) -> None:
    """The extras are used, not skipped: the stack on the family's model and on the
    same weights without its extra (biases zeroed, q/k norms dropped, Gemma's query
    scale set to 1, Mistral's windows dropped) give different logits."""
    hf = make_hf_llama(**_FAMILIES[family])
    model = load_model(str(save_hf_llama(hf, tmp_path / "m")), dtype="bfloat16", device="cpu").model
    length = 12 if family == "mistral" else 6  # past Mistral's windows of 8
    pool, tables = _prefill(model, 1, length)
    seqs = [SeqInput(tables[0], length, 1)]
    full = NativeDecode(model, narrow=False).forward([3], seqs, copy.deepcopy(pool))
    attn_w, _ = model.layer_weights(False)[0]
    if family == "qwen2":
        assert attn_w.qkv_bias is not None
        with torch.no_grad():
            attn_w.qkv_bias.zero_()
    elif family == "qwen3":
        assert attn_w.q_norm is not None
        with torch.no_grad():
            attn_w.q_norm.fill_(1.0)
    elif family == "mistral":
        assert model.config.window_of(0) == 8
        model.config = dataclasses.replace(model.config, layer_types=())  # no windows
    else:
        model.shape = dataclasses.replace(model.shape, query_scale=1.0)
    cut = NativeDecode(model, narrow=False).forward([3], seqs, copy.deepcopy(pool))
    assert (full - cut).abs().max() > 0.01


def test_a_float16_model_is_not_served() -> None:
    model = load_model("tiny-random", dtype="float32", device="cpu").model
    model.to(torch.float16)
    assert "a bf16 or float32 model" in str(unsupported(model, False))


@needs_kernel
@pytest.mark.parametrize("native", ["1", "0"])
def test_compiling_picks_the_stack_unless_told_not_to(
    native: str, checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compile_model(decode_graph=True)` gives a model the stack (nothing more to
    compile: four graphs, the pieces) where it serves, the compiled decode graph with
    `TOKENFLEET_NATIVE_DECODE=0`; the worker's hash field names which."""
    from tokenfleet.model.decode_graph import DecodeGraph
    from tokenfleet.worker.main import _decode_path

    monkeypatch.setenv("TOKENFLEET_NATIVE_DECODE", native)
    model = _tiny(checkpoint, "dense")
    report = compile_model(model, decode_graph=True)
    if native == "1":
        assert isinstance(model.decode_graph, NativeDecode) and report.graphs == 4
        assert _decode_path(model) == "native"
    else:
        assert isinstance(model.decode_graph, DecodeGraph) and report.graphs == 5
        assert _decode_path(model) == "compiled (TOKENFLEET_NATIVE_DECODE=0)"
    pool, tables = _prefill(model, 2, 6)
    logits = model.forward([1, 2], [SeqInput(tables[r], 6, 1) for r in range(2)], pool)
    assert logits.shape == (2, model.config.vocab_size) and torch.isfinite(logits).all()


@needs_kernel
@pytest.mark.parametrize(
    ("weights", "dtype", "family"),
    [
        ("dense", "bfloat16", "llama"),
        pytest.param("int8", "bfloat16", "llama", marks=needs_vnni),
        pytest.param("int4", "bfloat16", "llama", marks=needs_vnni),
        pytest.param("quantized", "bfloat16", "llama", marks=needs_vnni),
        ("dense", "float32", "llama"),
        pytest.param("int8", "float32", "llama", marks=needs_vnni),
        pytest.param("int4", "bfloat16", "gemma3", marks=needs_vnni),
        ("dense", "bfloat16", "gemma3"),
    ],
)
def test_one_call_from_ids_to_logits_gives_the_layers_then_the_head_bit_for_bit(
    weights: str,
    dtype: str,
    family: str,
    checkpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`DecodeStack.decode` (the embedding, Gemma's scale on it, rope rows from the
    tables, the layers, the LM head writing float32) against the stack's layers with the
    embedding, rope and head done in Python as before: the same logits and K/V, bit for
    bit, over 14 steps across block edges (and Gemma 3's windows and second rope base)."""
    import tokenfleet.model.native_decode as native

    if family == "gemma3":
        hf = make_hf_llama(**_FAMILIES["gemma3"])
        path = str(save_hf_llama(hf, tmp_path / "m"))
        model = load_model(path, dtype=dtype, device="cpu").model
        if weights in ("int8", "int4"):
            model.add_narrow(weights, 4)
    else:
        model = _tiny(checkpoint, weights, dtype)
    narrow = weights in ("int8", "int4")
    stack = NativeDecode(model, narrow=narrow)
    pool, tables = _prefill(model, 3, 5)
    python_pool = copy.deepcopy(pool)
    ids = [11, 12, 13]
    for step in range(14):
        seqs = [SeqInput(tables[r], 5 + step, 1) for r in range(3)]
        assert native._head(model.head_weight(narrow, 3), model.dtype, 3) is not None
        got = stack.forward(ids, seqs, pool)
        with monkeypatch.context() as m:
            m.setattr(native, "_head", lambda *a: None)  # the head in Python
            want = stack.forward(ids, seqs, python_pool)
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want), f"step {step}"
        ids = [int(t) for t in got.argmax(-1)]
    assert torch.equal(pool.k, python_pool.k) and torch.equal(pool.v, python_pool.v)


@pytest.mark.parametrize(("head_dim", "theta"), [(64, 10_000.0), (128, 500_000.0), (80, 1e6)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_table_rows_are_the_rows_computed_alone(
    head_dim: int, theta: float, dtype: torch.dtype
) -> None:
    """A decode tick takes its rope rows from `RopeTable` by position: each row holds
    the bits `rope_cos_sin` gives for that position in any set of positions, after the
    table has grown past its first rows too."""
    from tokenfleet.model.native_decode import RopeTable
    from tokenfleet.model.rope import rope_cos_sin

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    table = RopeTable(inv_freq, dtype, rows=8)
    table.cover(3000)
    assert table.cos.shape == (4096, head_dim)
    gen = torch.Generator().manual_seed(0)
    for size in (1, 3, 8, 17, 40):
        for _ in range(10):
            pos = torch.randint(0, 3001, (size,), generator=gen)
            cos, sin = rope_cos_sin(inv_freq, pos, dtype)
            assert torch.equal(table.cos[pos], cos) and torch.equal(table.sin[pos], sin)


@needs_kernel
def test_a_token_id_outside_the_vocabulary_is_refused_by_name(checkpoint: str) -> None:
    """A bad id fails the tick with a named error before any layer runs: nothing is
    written to the pool."""
    model = _tiny(checkpoint, "dense")
    stack = NativeDecode(model, narrow=False)
    pool, tables = _prefill(model, 2, 3)
    before = pool.k.clone()
    seqs = [SeqInput(tables[r], 3, 1) for r in range(2)]
    for bad in (model.config.vocab_size, -1):
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            stack.forward([1, bad], seqs, pool)
    assert torch.equal(pool.k, before)


@needs_kernel
def test_slots_and_blocks_outside_the_pool_are_refused_by_name(checkpoint: str) -> None:
    """A bad block table fails the call with a named error; nothing is written."""
    model = _tiny(checkpoint, "dense")
    stack = NativeDecode(model, narrow=False)
    pool, _ = _prefill(model, 1, 3)
    before = pool.k.clone()
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        stack.forward([1], [SeqInput([pool.num_blocks + 5], 3, 1)], pool)
    # a context block outside the pool (the new token's own block inside it)
    with pytest.raises(RuntimeError, match="block out of the pool"):
        stack.forward([1], [SeqInput([pool.num_blocks + 5, 0], 4, 1)], pool)
    assert torch.equal(pool.k, before)


@needs_kernel
def test_weights_of_the_wrong_shape_are_refused_when_bound(checkpoint: str) -> None:
    """The stack checks what its loops read without bounds: a norm weight of the wrong
    length fails the binding by name, before any tick."""
    model = _tiny(checkpoint, "dense")
    model.blocks[1].post_attention_layernorm.weight.data = torch.ones(7, dtype=torch.bfloat16)
    model._layer_weights = None  # gathered again from the modules
    with pytest.raises(RuntimeError, match="norm weights"):
        NativeDecode(model, narrow=False)


@needs_vnni
@pytest.mark.parametrize("how", ["--no-compile", "compile failed"])
def test_an_uncompiled_model_with_packed_weights_still_gets_the_stack(
    how: str, checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stack compiles nothing, so a model whose decode ticks read packed weights
    (`--quant` here, a default start's narrow set alike) left uncompiled (asked not to,
    or inductor failed) still decodes on it, and its hash says so; a dense model
    without packed weights stays eager as before."""
    import tokenfleet.model.compiled as compiled_mod
    from tokenfleet.worker.main import _compile

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler")

    asked = False
    if how == "compile failed":
        monkeypatch.setattr(compiled_mod, "compile_model", no_compiler)
        asked = None  # not asked for: a failed compile serves eagerly
    monkeypatch.setenv("TOKENFLEET_PAGED_ATTENTION", "1")
    loaded = load_model(checkpoint, dtype="bfloat16", device="cpu", quant="int8")
    info = _compile(loaded, asked)
    assert info["decode_path"] == "native" and info["decode_graph"] is True
    assert loaded.model.compiled is None and isinstance(loaded.model.decode_graph, NativeDecode)
    if how == "compile failed":
        assert "no C++ compiler" in str(info["compile_error"])
    dense = load_model(checkpoint, dtype="bfloat16", device="cpu")
    assert _compile(dense, False) == {} and dense.model.decode_graph is None
