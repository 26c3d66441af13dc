"""A decode tick as ONE compiled graph: every layer, attention included (the LM head
right after it).

The piecewise compile (`compiled.py`) leaves attention eager, so a tick of a 30-layer
model is 31 calls into compiled code, each with its guards and wrappers, and 30 eager
attentions with their gathers and SDPA set-up between them: 7 ms of a one-row tick on
SmolLM2 that are neither matmul nor arithmetic. A tick in which every row is a decode
(one new token per sequence, the steady state) has a shape simple enough to compile
whole: each row attends over its own past keys, read from the paged pool in place
through its block table by a small C++ kernel (`attention/paged_cpu.cpp`, called as an
extern op, one per layer), plus its own new key. No gathered copy of the context, one
call into compiled code per tick.

The pool is only read inside the graph. The tick's new K/V of every layer come out
of it ([layers, B, KVH, hd]) and are written into the pool by one `index_copy_` per
pool after it, so the graph has no mutated input (a functionalised scatter into a
graph input would copy the whole pool every tick).

Ticks that carry a prefill chunk keep the piecewise path: a chunk attends over many
queries at once, where SDPA's blocked kernel beats loops.

Dynamic in rows, block-table width and pool size (one graph, plus the one-row graph
torch specialises); the warm-up compiles both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tokenfleet.model.attention import paged_cpu
from tokenfleet.model.layers import (
    AttnWeights,
    LayerShape,
    MlpWeights,
    attn_in,
    attn_out_mlp,
    flatten_weights,
    linear,
    rms_norm,
    unflatten_weights,
)
from tokenfleet.model.tick_inputs import SeqInput, decode_rows

if TYPE_CHECKING:
    from tokenfleet.model.kv_pool import KVPool
    from tokenfleet.model.llama import LlamaModel


def _tick(
    ids: Tensor,
    positions: Tensor,
    tables: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    embed: Tensor,
    inv_freq: Tensor,
    inv_freq_local: Tensor,
    norm: Tensor,
    spec: Any,
    shape: LayerShape,
    *w: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """ids, positions [B]; tables [B, W]; pools [layers, S, KVH, hd] -> the final norm's
    output [B, hidden] (the LM head runs after the graph) and the new k, v [layers, B,
    KVH, hd]."""
    attn_spec, mlp_spec, per_layer, split, windows, embed_scale, block = spec
    dtype = embed.dtype

    def rope(freq: Tensor) -> tuple[Tensor, Tensor]:
        f = positions[:, None].float() * freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    cos, sin = rope(inv_freq)
    wcos, wsin = rope(inv_freq_local)
    x = torch.nn.functional.embedding(ids, embed)
    if embed_scale is not None:
        x = x * torch.tensor(embed_scale, dtype=dtype)
    ks: list[Tensor] = []
    vs: list[Tensor] = []
    for i, window in enumerate(windows):
        lw = w[i * per_layer : (i + 1) * per_layer]
        attn_w = AttnWeights(*unflatten_weights(attn_spec, lw[:split]))
        mlp_w = MlpWeights(*unflatten_weights(mlp_spec, lw[split:]))
        c, s = (wcos, wsin) if window else (cos, sin)
        q, k, v = attn_in(x, attn_w, c, s, shape)
        att = torch.ops.tokenfleet.decode_attention(
            q, k_pool, v_pool, k, v, tables, positions, i, block, window
        )
        x = attn_out_mlp(x, att, mlp_w, shape)
        ks.append(k)
        vs.append(v)
    normed = rms_norm(x, norm, shape.eps, shape.scale_fp32)
    return normed, torch.stack(ks), torch.stack(vs)


def cpp_wrapper() -> bool:
    """Whether the graph's calls are made from C++ (inductor's `cpp_wrapper`): a tick's
    ~270 calls (fused loops, the int4 / int8 kernels, the attention op) from one
    compiled C++ function instead of a generated Python one. On SmolLM2 at one row that
    is 0.6-0.7 ms of a 5.5-6.3 ms tick (bench/tick_profile.py, EPYC Zen 5); the cost is
    a C++ compile of the wrapper at the first start (inductor caches it). On unless
    `TOKENFLEET_DECODE_CPP_WRAPPER=0`."""
    return os.environ.get("TOKENFLEET_DECODE_CPP_WRAPPER", "1") != "0"


# Inductor splits a fused loop between the threads (an OpenMP parallel region) when each
# thread gets at least `cpp.min_chunk_size` elements (512 by default). A decode tick's
# fused loops are small (8 rows of SmolLM2's MLP: 12,288 elements) and a tick has ~120
# of them, so most of their time went to waking the other thread: on an EPYC Zen 4 at 8
# rows the graph's own code took 2.23 ms a tick, 1.40 with this threshold (tick 12.35
# -> 10.90 ms, bench/tick_profile.py --inductor cpp.min_chunk_size=65536; one row
# unchanged: its graph, compiled for one row, ran serial loops already). Whether a wider
# tick's loops split follows the row count inductor saw when it compiled the graph (not
# measured past 8 rows); the attention and matmul kernels split their own work.
DECODE_MIN_CHUNK = 65536


def _how(mode: str) -> dict[str, Any]:
    """torch.compile's mode or options (it takes one or the other): on the CPU (the
    default mode) the C++ wrapper and serial fused loops for the tick's small tensors,
    else the mode as given (CUDA's reduce-overhead)."""
    if mode == "default":
        options: dict[str, Any] = {"cpp.min_chunk_size": DECODE_MIN_CHUNK}
        if cpp_wrapper():
            options["cpp_wrapper"] = True
        return {"options": options}
    return {"mode": mode}


class DecodeGraph:
    """The whole-tick compiled decode of one model (see the module docstring)."""

    def __init__(self, model: LlamaModel, *, narrow: bool, mode: str = "default") -> None:
        """The graph for the narrow weight set (`narrow`: the ticks `model.is_narrow`
        sends there) or the dense one (every decode-only tick)."""
        if model.shape.row_tile or model.shape.min_rows:
            raise ValueError("deterministic row tiles run eagerly, not compiled")
        if not paged_cpu.load():
            raise RuntimeError(f"the paged decode kernel did not build: {paged_cpu.failure()}")
        cfg = model.config
        self.narrow = narrow
        attn = [flatten_weights(a) for a, _ in model.layer_weights(narrow)]
        mlp = [flatten_weights(m) for _, m in model.layer_weights(narrow)]
        attn_spec, mlp_spec = attn[0][0], mlp[0][0]
        if any(a[0] != attn_spec for a in attn) or any(m[0] != mlp_spec for m in mlp):
            raise ValueError("layers with different weight layouts cannot share compiled code")
        split = len(attn[0][1])
        self._weights: list[Tensor] = []
        for (_, a), (_, m) in zip(attn, mlp, strict=True):
            self._weights += [*a, *m]
        windows = tuple(cfg.window_of(i) or 0 for i in range(cfg.num_layers))
        spec: tuple[Any, ...] = (
            attn_spec,
            mlp_spec,
            split + len(mlp[0][1]),
            split,
            windows,
            cfg.embed_scale,
        )
        self._spec = spec
        self._shape = model.shape
        self._model = model
        # Dynamic in the tick's rows, its tables' width and the pool's slots only: the
        # weights' shapes stay constants the generated loops are specialised on.
        self._fn = torch.compile(_tick, dynamic=False, fullgraph=True, **_how(mode))

    def serves(self, seqs: Sequence[SeqInput], narrow: bool) -> bool:
        """Whether a forward over `seqs` runs here: every seq a decode, on this set."""
        return narrow == self.narrow and all(s.num_new == 1 for s in seqs)

    @torch.inference_mode()
    def forward(
        self, input_ids: Tensor | Sequence[int], seqs: Sequence[SeqInput], kv: KVPool
    ) -> Tensor:
        """Every seq one new token (a decode): logits [B, vocab]; K/V written to `kv`."""
        m = self._model
        bs = kv.block_size
        tables, pos, at = decode_rows(seqs, bs)
        flat = (kv.num_layers, kv.num_slots, kv.num_kv_heads, kv.head_dim)
        k_pool, v_pool = kv.k.view(flat), kv.v.view(flat)
        inv_local = m._inv_freq_local if m._inv_freq_local is not None else m._inv_freq
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        for t, dims in ((ids, (0,)), (pos, (0,)), (tables, (0, 1)), (k_pool, (1,)), (v_pool, (1,))):
            torch._dynamo.mark_dynamic(t, dims)
        normed, k_new, v_new = self._fn(
            ids,
            pos,
            tables,
            k_pool,
            v_pool,
            m.embed_tokens.weight,
            m._inv_freq,
            inv_local,
            m.norm.weight,
            (*self._spec, bs),
            self._shape,
            *self._weights,
        )
        k_pool.index_copy_(1, at, k_new.to(k_pool.dtype))  # (a float16 pool: rounded)
        v_pool.index_copy_(1, at, v_new.to(v_pool.dtype))
        # the LM head outside the graph: which copy serves depends on the rows
        lm_head = m.head_weight(self.narrow, normed.shape[0])
        logits = linear(normed, lm_head, None, self._shape)
        return logits.float()
