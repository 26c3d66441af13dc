"""Decode ticks on CUDA replayed from captured CUDA graphs.

On a GPU a small model's decode tick is bound by the host, not the device: SmolLM2's
30 layers are hundreds of kernel launches and the Python between them, 16 ms a tick eager on
an H200 whatever the row count (bench/results-gpu-check-h200-2026-12-04.json), where
the arithmetic takes a small fraction of that. A CUDA graph records the launches of one
tick once and replays them with one call; what the host then does per tick is to copy
the tick's inputs into the graph's static buffers and launch it.

A graph replays fixed shapes at fixed addresses, so the tick is padded:

- rows to a bucket (1, 2, 4, 8, ... up to the engine's batch): padding rows decode
  token 0 at position 0 through an all-zero block table; they attend to their own key
  only and their outputs are dropped;
- each row's block table to a width bucket (1, 2, 4, ... blocks up to the longest
  context a job may reach): the row's keys are gathered from the pool through it and
  those at or past the row's position are masked out.

One graph per (rows, width) pair a tick has needed, captured on first use (a capture
is one warm-up forward and one recorded forward: tens of ms) into one shared memory
pool; the worker captures the row buckets of short contexts at start.

Inside the graph the pool is only read: each row attends over its context gathered
from the pool plus its own new key, and the tick's new K/V of every layer come out
([layers, rows, KVH, hd]). The real rows' K/V are written into the pool after the
replay by one `index_copy_` per pool (a padding row has no slot to write).

Decode-only ticks only (the steady state); a tick with a prefill chunk runs eagerly.
Not under `--deterministic` (its row tiles are eager code of their own).

On a CPU there is nothing to capture: `CudaGraphDecode(capture=False)` runs the same
padded tick eagerly on the same static buffers, which is how the tests check the
padding, the masks and the writes on a machine without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenfleet.model.layers import attn_in, attn_out_mlp, head
from tokenfleet.model.quant import weight_of
from tokenfleet.model.rope import rope_cos_sin
from tokenfleet.model.tick_inputs import SeqInput

if TYPE_CHECKING:
    from tokenfleet.model.kv_pool import KVPool
    from tokenfleet.model.llama import LlamaModel


def bucket(n: int, limit: int) -> int:
    """The smallest power of two >= n, at most `limit` (n <= limit)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


@dataclass
class _Graph:
    """One captured tick: its static input buffer, outputs and the graph (None: eager)."""

    rows: int
    width: int
    inputs: Tensor  # [rows * (3 + width)] int64: ids | positions | tables | write slots
    logits: Tensor | None = None  # [rows, vocab] float32
    k_new: Tensor | None = None  # [layers, rows, KVH, hd]
    v_new: Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


@dataclass
class GraphStats:
    """What the graphs have done: the worker's hash carries it."""

    captured: list[tuple[int, int]] = field(default_factory=list)  # (rows, width) pairs
    capture_s: float = 0.0
    ticks: int = 0  # forwards served here
    replays: int = 0  # ... of them replayed from a captured graph


class CudaGraphDecode:
    """Decode-only ticks of `model` from captured graphs (see the module docstring).

    `max_rows`: the most rows a tick may carry (the engine's batch); `max_context`: the
    longest context a row may reach, in tokens (sets the widest table bucket)."""

    def __init__(
        self, model: LlamaModel, *, max_rows: int, max_context: int, capture: bool | None = None
    ) -> None:
        if model.deterministic is not None:
            raise ValueError("--deterministic ticks run eagerly, not from CUDA graphs")
        if model.narrow is not None:
            raise ValueError("CUDA graphs serve the dense weights; narrow sets are a CPU plan")
        if max_rows < 1 or max_context < 1:
            raise ValueError(f"bad limits: {max_rows} rows, {max_context} tokens")
        self.capture = model.device.type == "cuda" if capture is None else capture
        if self.capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, not one on {model.device}")
        self._model = model
        self.max_rows = max_rows
        self.max_context = max_context
        self.max_width = 0  # the widest table in blocks: set from the pool by `bind`
        # A graph reads the pool it was recorded on, at its addresses: the graphs belong
        # to one pool (`bind`), the engine's, which lives as long as the worker.
        self._kv: KVPool | None = None
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = None  # the graphs' shared memory pool (a handle)
        self.stats = GraphStats()
        cfg = model.config
        self._windows = tuple(cfg.window_of(i) or 0 for i in range(cfg.num_layers))
        device = model.device
        self._inv_freq = model._inv_freq.to(device)
        local = model._inv_freq_local
        self._inv_freq_local = None if local is None else local.to(device)
        scale = cfg.embed_scale  # rounded to the model dtype, as the eager forward does
        self._embed_scale = None if scale is None else float(torch.tensor(scale, dtype=model.dtype))

    def serves(self, seqs: Sequence[SeqInput], narrow: bool) -> bool:
        """Whether a forward over `seqs` replays here: every seq a decode, on the dense
        set, within the row and context limits."""
        if narrow or len(seqs) > self.max_rows:
            return False
        return all(s.num_new == 1 and s.start_pos < self.max_context for s in seqs)

    @torch.inference_mode()
    def bind(self, kv: KVPool, widths: Sequence[int] = (1,)) -> None:
        """Serve ticks on `kv` from now on (graphs of another pool are dropped), and
        capture every row bucket at the given table widths (in blocks) now rather than
        at a first tick."""
        self._kv = kv
        self._graphs.clear()
        # and a memory pool of their own: recording into the pool of graphs since freed
        # trips an assertion in torch's allocator (seen with torch 2.11 on an H200)
        self._pool = None
        self.max_width = -(-self.max_context // kv.block_size)
        rows = 1
        while True:
            for w in widths:
                self._get(rows, min(w, self.max_width), kv)
            if rows >= self.max_rows:
                break
            rows = min(2 * rows, self.max_rows)

    @torch.inference_mode()
    def forward(
        self, input_ids: Tensor | Sequence[int], seqs: Sequence[SeqInput], kv: KVPool
    ) -> Tensor:
        """Every seq one new token (a decode): logits [len(seqs), vocab]; K/V written."""
        if kv is not self._kv:
            self.bind(kv, widths=())
        self.stats.ticks += 1
        bs = kv.block_size
        n = len(seqs)
        need = max(s.start_pos // bs + 1 for s in seqs)
        g = self._get(bucket(n, self.max_rows), bucket(need, self.max_width), kv)
        ids = input_ids.tolist() if isinstance(input_ids, Tensor) else list(input_ids)
        rows, width = g.rows, g.width
        tables = [0] * (rows * width)
        positions: list[int] = []
        slots: list[int] = []
        for i, s in enumerate(seqs):
            p = s.start_pos
            used = s.block_table[: p // bs + 1]
            tables[i * width : i * width + len(used)] = used
            positions.append(p)
            slots.append(used[-1] * bs + p % bs)
        pad = [0] * (rows - n)
        g.inputs.copy_(torch.tensor([*ids, *pad, *positions, *pad, *tables, *slots, *pad]))
        if g.graph is not None:
            g.graph.replay()
            self.stats.replays += 1
        else:
            g.logits, g.k_new, g.v_new = self._tick(g, kv)
        assert g.logits is not None and g.k_new is not None and g.v_new is not None
        at = g.inputs[rows * (2 + width) :][:n]
        flat = (kv.num_layers, kv.num_slots, kv.num_kv_heads, kv.head_dim)
        kv.k.view(flat).index_copy_(1, at, g.k_new[:, :n])
        kv.v.view(flat).index_copy_(1, at, g.v_new[:, :n])
        return g.logits[:n].clone()

    def _get(self, rows: int, width: int, kv: KVPool) -> _Graph:
        g = self._graphs.get((rows, width))
        if g is None:
            started = time.perf_counter()
            inputs = torch.zeros(rows * (3 + width), dtype=torch.long, device=kv.k.device)
            g = _Graph(rows, width, inputs)
            if self.capture:
                self._record(g, kv)
            self._graphs[(rows, width)] = g
            self.stats.captured.append((rows, width))
            self.stats.capture_s += time.perf_counter() - started
        return g

    def _record(self, g: _Graph, kv: KVPool) -> None:
        """One warm-up forward on a side stream (the allocator and cuBLAS settle their
        workspaces there), then the recorded one; the pool's contents are only read."""
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._tick(g, kv)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call another thread of the worker makes meanwhile is no
        # error in this capture (it is not recorded either)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            g.logits, g.k_new, g.v_new = self._tick(g, kv)
        g.graph = graph
        # The first launch of a graph uploads it to the device (milliseconds for a
        # tick's hundreds of kernels): done here, not in the first tick that needs it.
        # A replay only reads the pool and writes the graph's own outputs.
        graph.replay()
        torch.cuda.current_stream().synchronize()

    def _tick(self, g: _Graph, kv: KVPool) -> tuple[Tensor, Tensor, Tensor]:
        """The padded tick on `g`'s buffers: logits [rows, vocab] float32 and the new
        k, v [layers, rows, KVH, hd]. Every op reads the static buffers (capturable)."""
        m = self._model
        rows, width, bs = g.rows, g.width, kv.block_size
        ids = g.inputs[:rows]
        positions = g.inputs[rows : 2 * rows]
        tables = g.inputs[2 * rows : (2 + width) * rows].view(rows, width)
        cos, sin = rope_cos_sin(self._inv_freq, positions, m.dtype)
        wcos, wsin = cos, sin
        if self._inv_freq_local is not None:
            wcos, wsin = rope_cos_sin(self._inv_freq_local, positions, m.dtype)
        keys = torch.arange(width * bs + 1, device=ids.device)[None, :]  # [1, L + 1]
        before = keys < positions[:, None]  # context keys strictly before each row's own
        own = keys == width * bs  # the last key: the row's own new one
        masks: dict[int, Tensor] = {}
        for window in set(self._windows):
            seen = before & (keys > positions[:, None] - window) if window else before
            masks[window] = (seen | own)[:, None, None, :]  # [rows, 1, 1, L + 1]
        x = m.embed_tokens(ids)
        if self._embed_scale is not None:
            x = x * self._embed_scale
        ks: list[Tensor] = []
        vs: list[Tensor] = []
        for i, (attn_w, mlp_w) in enumerate(m.layer_weights()):
            window = self._windows[i]
            c, s = (wcos, wsin) if window else (cos, sin)
            q, k, v = attn_in(x, attn_w, c, s, m.shape)
            att = _attend(q, k, v, kv.k[i], kv.v[i], tables, masks[window])
            x = attn_out_mlp(x, att, mlp_w, m.shape)
            ks.append(k)
            vs.append(v)
        logits = head(x, m.norm.weight, weight_of(m.lm_head), m.shape)
        return logits, torch.stack(ks), torch.stack(vs)


def _attend(
    q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, mask: Tensor
) -> Tensor:
    """q [B, H, hd], the rows' own k / v [B, KVH, hd], one layer's pool [blocks, block,
    KVH, hd], tables [B, W] -> [B, H, hd]: each row over its gathered context (masked)
    and its own new key, the query heads of a KV head as that head's query rows."""
    b, h, hd = q.shape
    kvh = k.shape[1]
    flat = tables.flatten()
    ctx_k = k_pool.index_select(0, flat).view(b, -1, kvh, hd)  # [B, W * block, KVH, hd]
    ctx_v = v_pool.index_select(0, flat).view(b, -1, kvh, hd)
    keys = torch.cat([ctx_k, k[:, None]], dim=1).transpose(1, 2)  # [B, KVH, L + 1, hd]
    values = torch.cat([ctx_v, v[:, None]], dim=1).transpose(1, 2)
    grouped = q.view(b, kvh, h // kvh, hd)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    return out.reshape(b, h, hd)


def install(model: LlamaModel, *, max_rows: int, max_context: int) -> CudaGraphDecode:
    """Give `model` graph-replayed decode ticks (`model.decode_graph`); the runner binds
    them to its KV pool when it allocates one (`TorchRunner.allocate_kv`)."""
    graphs = CudaGraphDecode(model, max_rows=max_rows, max_context=max_context)
    model.decode_graph = graphs
    return graphs
