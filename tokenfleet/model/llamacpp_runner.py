"""`LlamaCppRunner`: the engine's `ModelRunner` on llama.cpp's kernels.

The scheduler, budgets, sampler and everything above them stay tokenfleet's; the
forward is one `llama_decode` per tick, through llama-cpp-python's low-level
bindings (its ctypes layer, not its `Llama` class):

    TickPlan entries  ->  one llama_batch: each decode row and prefill chunk, one
                          llama.cpp sequence id per session, logits flagged only where
                          a token is sampled (or a prompt logprob is asked)
    llama_decode      ->  llama.cpp splits the batch into its ubatches and runs them
    flagged logits    ->  TickSampler.finish: our sampler, masks and logprobs, so
                          seeds, grammars and penalties behave as on the torch runner

KV. llama.cpp keeps its own cache (cells, each tagged with the sequences that use
it), so the scheduler's block tables are not addresses here: the runner sizes that
cache to hold every token the scheduler's blocks can (its cells are the node's KV
budget, rounded up by llama.cpp) and tracks how far each sequence's cells go. A plan
that restarts a session at an earlier position (a retry after a failed tick) removes
the cells from there first. Two layouts (`LlamaCppOptions.kv_streams`):

    False (default)  one pool of cells for every sequence (`kv_unified`), as the
                     scheduler's one block pool: a job may use every cell; but each
                     decode row's attention walks the whole range of cells in use (the
                     other sequences' masked), a cost that grows with the jobs beside it
    True             llama-server's layout (`-np N`, N = `max_sequences`, the worker's
                     `--kv-streams N`): N streams of cells/N each (rounded down to
                     llama.cpp's 256), a sequence per stream; a row's attention walks
                     its own stream's cells only. A job must fit one stream
                     (`ModelSpec.max_session_tokens`: admission refuses a longer one,
                     the gateway sees it in `max_job_tokens`); no prefix sharing. Each
                     tick's rows go in sequence id order, and ids are kept consecutive
                     (`_compact`): llama.cpp cuts a ubatch at the first id that is not
                     the previous one + 1.

Prefix sharing. `BlockCells` maps each block of the scheduler's pool to the sequences
whose cells hold it. A session whose plan starts past a prefix the engine's cache found
borrows each cached block's cells (`llama_memory_seq_cp`: a tag, no copy); a block
nobody holds any more is computed again from the session's own tokens. A finished
session's sequence is kept while it holds blocks (moved to an id above the live ones:
`llama_decode` takes ids below `n_seq_max` only), at most `max_kept`, the oldest
dropped first; else `release` removes its cells (`llama_memory_seq_rm`). When the
scheduler hands a block out again and a session writes it, the cells its earlier
contents left are removed, so llama.cpp's cells in use never exceed the block pool.
Sliding-window and recurrent models share nothing (`ModelSpec.shares_prefix`: their
caches drop, or never had, the cells a later session would borrow). docs/operations.md,
"Choosing a runner".

Budgets are what llama.cpp says it allocated (its log lines at load): the model's
buffers, the KV cells and the compute and output buffers; the fixed ones count as the
node's weight bytes, so admission stays exact. Wherever llama.cpp may repack weights
(its "extra buffer types": the AMX layouts below, and on other CPUs the layouts of its
own AVX and NEON kernels), the file is read rather than mapped: a mapped buffer spans the
file from its first to its last tensor left in place, so the repacked tensors would be
counted twice, once mapped and once repacked (SmolLM2's Q4_1 file on an AMX Xeon: 187
MiB logged where 124 are held; read, the CPU buffer holds only the tensors left in
place). The price: workers on one host no longer share the file's pages.

AMX. On a CPU with AMX, llama.cpp repacks weights into an AMX buffer ("extra buffer
types"). Built by gcc 12 from the released source, that path crashed in the first decode
(llama.cpp#20824), taken to be the miscompile that makes llama-server SIGILL (gcc drops
the stores that fill the AMX tile config; with the fix the runner's tests pass with
repacking on, the unpatched crash not reproduced since). `make llamacpp`
builds llama-cpp-python with a compiler barrier there (scripts/llama_cpp_python.sh) and
labels its version `+tokenfleet.amx`; with that build the runner keeps the repacking on
(llama.cpp's AMX kernels, as llama-server built the same way uses them). With any other
build it turns the repacking off on AMX CPUs (`use_extra_bufts = false`: the plain
AVX-512 kernels). `info` says which and why.

llama-cpp-python is pinned (`LLAMA_CPP_PYTHON`, a local version label allowed): from
0.3.17 its bindings expose only the `llama_memory_*` KV calls (the `llama_kv_self_*`
ones are gone), and the ctypes structs this module fills (`llama_batch`, the model and
context params) must match the library it was built with. It is an optional extra built
from source (`make llamacpp`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import heapq
import logging
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from tokenfleet.errors import ModelLoadError
from tokenfleet.model.cpu import cpu_flags
from tokenfleet.model.tick_sampling import Echo, TickSampler
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.seam import (
    DecodeStep,
    ModelSpec,
    PrefillChunk,
    ResolvedSampling,
    Sampled,
    SamplingDefaults,
    SeqState,
    TickPlan,
    TokenMasks,
)

__all__ = ["LLAMA_CPP_PYTHON", "LlamaCppOptions", "LlamaCppRunner", "LlamaCppUnavailable"]

logger = logging.getLogger(__name__)

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned llama-cpp-python (pyproject's `llamacpp` extra)
AMX_FIXED = "tokenfleet.amx"  # the local version label of a build with the AMX tile-config fix
INSTALL_HINT = "make llamacpp (builds llama-cpp-python from source, ~15-20 min on 2 cores)"
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
KV_BYTES = 2  # llama.cpp's default K and V cache type: f16
STREAM_PAD = 256  # llama.cpp pads a stream's cells (n_ctx_seq) to this
MiB = 1024 * 1024

# llama.cpp's log levels (ggml.h) and the allocation lines it logs at load
_WARN, _ERROR, _CONT = 3, 4, 5
_BUFFER = re.compile(
    r"(?P<device>\S+)\s+(?P<kind>model|KV|compute|output) buffer size =\s*(?P<mib>[\d.]+) MiB"
)
# llama_decode's return codes (llama.h)
_DECODE_ERRORS = {
    1: "no KV slot for the batch",
    2: "aborted",
    -1: "invalid input batch",
}


class LlamaCppUnavailable(ModelLoadError):
    """llama-cpp-python is not installed (or not the pinned version)."""


@dataclass(frozen=True)
class LlamaCppOptions:
    """What the runner needs from the worker's settings to size llama.cpp's context."""

    kv_budget_bytes: int  # the node's KV budget: llama.cpp gets at least that many cells
    block_size: int  # the scheduler's KV block (cells are counted in its tokens)
    max_sequences: int  # sessions at once (the node's max_active): llama.cpp seq ids
    max_tick_tokens: int  # decode rows + prefill tokens one tick may carry
    threads: int | None = None  # None: one per core
    # llama.cpp's weight repacking; None: on, except on AMX CPUs with a build lacking the fix
    extra_bufts: bool | None = None
    # share cached prefixes between sessions (the engine's prefix cache) where the
    # model's KV allows it; how many finished sequences are kept for their cached
    # blocks (None: as many as max_sequences; at most the ids the live ones leave)
    prefix_sharing: bool = True
    max_kept: int | None = None
    # a KV stream per sequence (max_sequences streams), else one pool: see above
    kv_streams: bool = False
    # a llama.cpp built without OpenMP: compute on a pool of threads of our own that
    # sleep between ticks (see `ThreadPool`); False: llama.cpp's own, one made per tick
    thread_pool: bool = True


def import_llama_cpp() -> ModuleType:
    """llama-cpp-python's low-level bindings, or `LlamaCppUnavailable` saying how to get them."""
    try:
        import llama_cpp
        from llama_cpp import llama_cpp as bindings
    except ImportError as exc:
        raise LlamaCppUnavailable(
            f"--runner llamacpp needs llama-cpp-python=={LLAMA_CPP_PYTHON}: {INSTALL_HINT} ({exc})"
        ) from exc
    version = getattr(llama_cpp, "__version__", "?")
    if version.partition("+")[0] != LLAMA_CPP_PYTHON:
        raise LlamaCppUnavailable(
            f"--runner llamacpp is written against llama-cpp-python=={LLAMA_CPP_PYTHON} "
            f"(its ctypes structs must match the library), found {version}: {INSTALL_HINT}"
        )
    lib: ModuleType = bindings
    return lib


class _Log:
    """llama.cpp's log: warnings and errors go to Python's logging, the rest (much) is
    dropped unless captured (`capture()`: the lines of a load, read for the budget). One
    per process: llama.cpp has one log callback."""

    _installed: _Log | None = None

    def __init__(self, lib: ModuleType) -> None:
        self._lock = threading.Lock()
        self._level = 0
        self._captured: list[str] | None = None
        self._callback = lib.llama_log_callback(self._on_line)  # kept: C holds the pointer
        lib.llama_log_set(self._callback, ctypes.c_void_p(0))

    @classmethod
    def install(cls, lib: ModuleType) -> _Log:
        if cls._installed is None:
            cls._installed = cls(lib)
        return cls._installed

    def _on_line(self, level: int, text: bytes | None, _: Any) -> None:
        line = (text or b"").decode("utf-8", "replace")
        if level != _CONT:
            self._level = level
        with self._lock:
            if self._captured is not None:
                self._captured.append(line)
        if self._level >= _WARN and line.strip():
            logger.log(
                logging.ERROR if self._level == _ERROR else logging.WARNING,
                "llama.cpp: %s",
                line.rstrip(),
            )

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[str]]:
        """The lines llama.cpp logs inside the block (one load at a time)."""
        lines: list[str] = []
        with self._lock:
            self._captured = lines
        try:
            yield lines
        finally:
            with self._lock:
                self._captured = None


def buffer_bytes(lines: list[str]) -> dict[str, int]:
    """What llama.cpp logged it allocated, by kind (model, KV, compute, output), in bytes
    (summed over devices; its log rounds each to 0.01 MiB)."""
    out: dict[str, int] = {}
    for line in lines:
        m = _BUFFER.search(line)
        if m:
            out[m["kind"]] = out.get(m["kind"], 0) + round(float(m["mib"]) * MiB)
    return out


class LlamaCppRunner:
    """A GGUF file on llama.cpp, behind `ModelRunner` (see the module docstring)."""

    def __init__(self, path: str | Path, options: LlamaCppOptions) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"--runner llamacpp needs a .gguf file, {self.path} is not one")
        if not 1 <= options.max_sequences <= MAX_SEQUENCES:
            raise ModelLoadError(
                f"llama.cpp runs at most {MAX_SEQUENCES} sequences at once; "
                f"max_active is {options.max_sequences}"
            )
        streams = options.max_sequences if options.kv_streams else 0
        if streams and options.prefix_sharing:
            raise ModelLoadError("KV streams lend no cells: prefix sharing needs one pool")
        self.options = options
        lib = self.lib = import_llama_cpp()
        lib.llama_backend_init()
        amx = bool({"amx_int8", "amx_bf16", "amx_tile"} & cpu_flags())
        version = str(getattr(sys.modules.get("llama_cpp"), "__version__", "?"))
        amx_fixed = version.partition("+")[2] == AMX_FIXED
        extra = options.extra_bufts if options.extra_bufts is not None else amx_fixed or not amx
        threads = options.threads or os.cpu_count() or 1
        ubatch = min(options.max_tick_tokens, 512)  # llama-server's default ubatch
        with _Log.install(lib).capture() as lines:
            params = lib.llama_model_default_params()
            params.n_gpu_layers = 0
            params.use_extra_bufts = extra
            if extra:  # weights may be repacked: read the file, not mapped (see above)
                params.load_mode = lib.LLAMA_LOAD_MODE_NONE
            self.model = lib.llama_model_load_from_file(str(self.path).encode(), params)
            if not self.model:
                raise ModelLoadError(f"llama.cpp could not load {self.path} (its log says why)")
            self._tokenizer, self.source_quant = _read_gguf(self.path)
            spec = self._read_spec(lib)
            # the context: enough cells for every token the node's KV budget holds
            layout = spec.kv_layout(options.block_size)
            cells = layout.num_blocks_for_budget(options.kv_budget_bytes) * options.block_size
            per_stream = 0
            if streams:  # llama.cpp rounds a stream up to 256 cells: round down here
                per_stream = cells // streams // STREAM_PAD * STREAM_PAD
                if per_stream == 0:
                    raise ModelLoadError(
                        f"the KV budget holds {cells} cells: {streams} streams need "
                        f"{streams * STREAM_PAD} at least (fewer --kv-streams, or more --kv-mb)"
                    )
                cells = per_stream * streams
            cparams = lib.llama_context_default_params()
            cparams.n_ctx = max(cells, options.block_size)
            cparams.n_batch = options.max_tick_tokens
            cparams.n_ubatch = ubatch
            cparams.n_seq_max = options.max_sequences
            cparams.n_threads = threads
            cparams.n_threads_batch = threads
            cparams.kv_unified = not streams  # else a stream per sequence
            cparams.no_perf = True
            self.ctx = lib.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                raise ModelLoadError(f"llama.cpp could not create a context for {self.path}")
        self.pool: ThreadPool | None = None
        openmp = b"OPENMP = 1" in (lib.llama_print_system_info() or b"")
        if options.thread_pool and not openmp and threads > 1:
            self.pool = ThreadPool(lib, threads)
            self.pool.attach(self.ctx)
        self.memory = lib.llama_get_memory(self.ctx)
        self.cells = int(lib.llama_n_ctx(self.ctx))
        self.stream_cells = int(lib.llama_n_ctx_seq(self.ctx)) if streams else 0
        if streams and self.stream_cells * streams != self.cells:
            raise ModelLoadError(
                f"llama.cpp made {self.cells} cells for {streams} streams of "
                f"{self.stream_cells}, not {cells} of {per_stream}"
            )
        self.allocated = buffer_bytes(lines)
        fixed = sum(v for k, v in self.allocated.items() if k != "KV")
        refused = self._why_not_shared(lib)
        if not options.prefix_sharing:
            refused = "off: the worker's prefix cache is off (--prefix-cache turns it on)"
        if streams:
            refused = "off: a KV stream per sequence (--kv-streams) lends no cells"
        self._spec = replace(
            spec,
            weight_bytes=fixed or int(lib.llama_model_size(self.model)),
            shares_prefix=refused is None,
        )
        if streams:  # a session's cells are one stream's
            self._spec = replace(self._spec, max_session_tokens=self.stream_cells)
        self.info: dict[str, Any] = {
            "runner": "llamacpp",
            "llama_cpp_python": version,
            "extra_bufts": extra,
            "extra_bufts_why": (
                f"set to {extra}"
                if options.extra_bufts is not None
                else "on (no AMX)"
                if not amx
                else "on: AMX CPU, llama-cpp-python built with the AMX tile-config fix"
                if amx_fixed
                else (
                    "off: AMX CPU, and this llama-cpp-python lacks the AMX tile-config fix "
                    "(its weight repacking crashes: llama.cpp#20824; make llamacpp builds it)"
                )
            ),
            "cells": self.cells,
            "kv_streams": streams,
            "kv_layout": (
                f"{streams} streams of {self.stream_cells} cells (a job fits one)"
                if streams
                else "one pool (unified)"
            ),
            "threads": threads,
            "threads_between_ticks": (
                "OpenMP's (they spin a while after each tick)"
                if openmp
                else "a pool that sleeps (no polling)"
                if self.pool is not None
                else "none (llama.cpp starts its threads each tick)"
            ),
            "ubatch": ubatch,
            "allocated_mib": {k: round(v / MiB, 2) for k, v in self.allocated.items()},
            "prefix_sharing": refused or "on (cells lent between sequences)",
        }

        # one llama_batch, filled in place every tick (numpy views of its arrays)
        cap = options.max_tick_tokens
        self._token = np.zeros(cap, np.int32)
        self._pos = np.zeros(cap, np.int32)
        self._n_seq = np.ones(cap, np.int32)
        self._seq = np.zeros(cap, np.int32)
        self._flag = np.zeros(cap, np.int8)
        i32 = ctypes.POINTER(ctypes.c_int32)
        base = self._seq.ctypes.data
        self._seq_rows = (i32 * cap)(*(ctypes.cast(base + 4 * i, i32) for i in range(cap)))
        self._batch = lib.llama_batch(
            n_tokens=0,
            token=self._token.ctypes.data_as(i32),
            embd=None,
            pos=self._pos.ctypes.data_as(i32),
            n_seq_id=self._n_seq.ctypes.data_as(i32),
            seq_id=ctypes.cast(self._seq_rows, ctypes.POINTER(i32)),
            logits=self._flag.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        # llama.cpp sequence ids: llama_decode takes those below n_seq_max (the live
        # sessions'), handed out lowest first (a heap: with streams, a ubatch spans
        # the streams between its lowest and highest id); a unified cache keeps cells
        # of any id below its maximum, so a finished sequence kept for its cached
        # blocks moves to an id above them
        self._free_ids = list(range(options.max_sequences))
        self._free_kept = list(range(MAX_SEQUENCES - 1, options.max_sequences - 1, -1))
        self._seq_ids: dict[str, int] = {}  # session -> llama.cpp sequence id
        self._ends: dict[int, int] = {}  # sequence id -> positions its cells hold
        self._states: dict[str, SeqState] = {}  # session -> its state, as last planned
        self._block_size = options.block_size
        self._cells_of = BlockCells()  # which sequences' cells hold each KV block
        self._kept: OrderedDict[int, None] = OrderedDict()  # finished, oldest first
        self.max_kept = min(
            options.max_sequences if options.max_kept is None else options.max_kept,
            len(self._free_kept),
        )
        self.moved = 0  # sequences moved down to a free id (streams: `_compact`)
        self._freed = False  # a sequence id was freed since the last `_compact`
        self.recomputed_tokens = 0  # prefix tokens no kept sequence held any more
        self._recomputed: dict[str, int] = {}  # ... by session, while it runs
        self.sampling = TickSampler()

    def _read_spec(self, lib: ModuleType) -> ModelSpec:
        model = self.model
        vocab = lib.llama_model_get_vocab(model)
        n_head = int(lib.llama_model_n_head(model))
        arch = self._meta(lib, "general.architecture") or "llama"
        key_length = self._meta(lib, f"{arch}.attention.key_length")
        head_dim = int(key_length) if key_length else int(lib.llama_model_n_embd(model)) // n_head
        eos = {int(lib.llama_vocab_eos(vocab)), int(lib.llama_vocab_eot(vocab))}
        if self._tokenizer is not None:
            eos |= set(self._tokenizer.eos_token_ids)
        digest = hashlib.blake2b(digest_size=16)
        stat = self.path.stat()
        digest.update(f"llamacpp|{self.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        return ModelSpec(
            num_layers=int(lib.llama_model_n_layer(model)),
            num_kv_heads=int(lib.llama_model_n_head_kv(model)),
            head_dim=head_dim,
            kv_dtype_bytes=KV_BYTES,
            weight_bytes=int(lib.llama_model_size(model)),
            vocab_size=int(lib.llama_vocab_n_tokens(vocab)),
            max_context=int(lib.llama_model_n_ctx_train(model)),
            eos_token_ids=frozenset(t for t in eos if t >= 0),
            sampling_defaults=SamplingDefaults(),
            cache_identity=digest.hexdigest(),
        )

    def _why_not_shared(self, lib: ModuleType) -> str | None:
        """Why this model's KV cells cannot be lent between sessions, or None."""
        if lib.llama_model_is_recurrent(self.model) or lib.llama_model_is_hybrid(self.model):
            return "off: a recurrent state is one per sequence, not cells per position"
        if int(lib.llama_model_n_swa(self.model)) > 0:
            return "off: sliding-window layers drop the cells a later session would borrow"
        return None

    def _meta(self, lib: ModuleType, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = lib.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    # ---- ModelRunner -------------------------------------------------------------

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    def scratch_bytes(self, context_len: int) -> int:
        # llama.cpp's compute buffers are allocated once (counted in weight_bytes); what
        # one session adds is its logits row copied out and the sampler's work on it
        return 3 * 4 * self._spec.vocab_size

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self._block_size = block_size
        # with streams, the pool may hold up to a stream's rounding more than the cells:
        # at most `kv_streams` sessions of at most `stream_cells` tokens never reach it
        if not self.stream_cells and num_blocks * block_size > self.cells:
            raise ValueError(
                f"{num_blocks} KV blocks of {block_size} tokens do not fit llama.cpp's "
                f"{self.cells} cells (the runner was sized for a smaller KV budget)"
            )

    def execute(
        self,
        plan: TickPlan,
        sampling: Mapping[str, ResolvedSampling],
        masks: TokenMasks | None = None,
    ) -> list[int] | Sampled:
        n = plan.num_decode_tokens + plan.num_prefill_tokens
        if n > len(self._token):
            raise ValueError(f"a tick of {n} tokens exceeds the runner's {len(self._token)}")
        states = self.sampling.states(plan, sampling)
        if self._freed:  # new sessions take the lowest free ids, then gaps close
            for entry in plan.entries:
                self._seq_id(entry.seq.session_id)
            self._compact()
        fed: list[tuple[int, int]] = []  # (sequence id, first position) of each entry
        for entry in plan.entries:  # each sequence's cells end where its entry starts
            sid = self._seq_id(entry.seq.session_id)
            if self._spec.shares_prefix:  # what `release` keeps is read from it
                self._states[entry.seq.session_id] = entry.seq
            start = entry.position if isinstance(entry, DecodeStep) else entry.start
            self._place(sid, entry, start)
            fed.append((sid, start))
        # the batch's rows: entries in sequence id order with streams (llama.cpp cuts a
        # ubatch at the first id that is not the last one + 1), else in the plan's order
        order = list(range(len(fed)))
        if self.stream_cells:
            order.sort(key=lambda i: fed[i][0])
        first_row = [0] * len(fed)
        at = 0
        for i in order:
            entry, (sid, start) = plan.entries[i], fed[i]
            ids = [entry.token_id] if isinstance(entry, DecodeStep) else entry.token_ids
            end = at + len(ids)
            self._token[at:end] = ids
            self._pos[at:end] = np.arange(start, start + len(ids), dtype=np.int32)
            self._seq[at:end] = sid
            first_row[i] = at
            at = end
        flagged: list[int] = []  # batch rows whose logits are read
        sample_rows: list[int] = []  # in the plan's order, as the sampler reads them
        echoes: list[Echo] = []
        for i, entry in enumerate(plan.entries):
            if isinstance(entry, DecodeStep):
                last, samples = first_row[i], True
            else:
                last, samples = first_row[i] + entry.length - 1, entry.samples
                echo = Echo.of(entry, first_row[i])
                if echo is not None:
                    echoes.append(echo)
                    flagged.extend(echo.rows)
            if samples:
                sample_rows.append(last)
                flagged.append(last)
        self._flag[:n] = 0
        self._flag[flagged] = 1
        self._batch.n_tokens = n
        code = int(self.lib.llama_decode(self.ctx, self._batch))
        if code != 0:
            for sid, start in fed:  # what a failed tick may have written is not kept
                self._cut(sid, start)
            reason = _DECODE_ERRORS.get(code, "error")
            raise RuntimeError(f"llama_decode failed: {code} ({reason})")
        for entry, (sid, start) in zip(plan.entries, fed, strict=True):
            self._ends[sid] = start + (1 if isinstance(entry, DecodeStep) else entry.length)

        if not flagged:  # prefill chunks that neither sample nor echo: nothing to read
            return []
        out_rows = sorted(set(flagged))
        vocab = self._spec.vocab_size
        ptr = self.lib.llama_get_logits(self.ctx)
        every = np.ctypeslib.as_array(ptr, shape=(len(out_rows), vocab))
        row_of = {row: i for i, row in enumerate(out_rows)}
        logits = torch.from_numpy(every[[row_of[r] for r in sample_rows]])
        prompt = None
        if echoes:
            prompt = torch.from_numpy(every[[row_of[r] for e in echoes for r in e.rows]])
        return self.sampling.finish(plan, sampling, masks, states, logits, prompt, echoes)

    @property
    def threads(self) -> int:
        """The threads llama.cpp computes a tick on."""
        return int(self.lib.llama_n_threads(self.ctx))

    def set_threads(self, n: int) -> None:
        """Compute the next ticks on `n` threads (the worker's thread governor calls this
        between ticks when a neighbour takes cores, or leaves them)."""
        self.lib.llama_set_n_threads(self.ctx, n, n)

    def recomputed(self, session_id: str) -> int:
        return self._recomputed.get(session_id, 0)

    def release(self, session_id: str) -> None:
        """The session ended. With prefix sharing its sequence is kept with the cells of
        the blocks the engine registered in its cache (the rest go now; a block written
        again later drops its cells too), the oldest kept one dropped past `max_kept`;
        else its cells go now."""
        self.sampling.release(session_id)
        self._recomputed.pop(session_id, None)
        state = self._states.pop(session_id, None)
        sid = self._seq_ids.pop(session_id, None)
        if sid is None:
            return
        self._ends.pop(sid, None)
        cached = 0 if state is None else state.num_registered * self._block_size
        if not (self._spec.shares_prefix and self.max_kept and cached):
            self._drop(sid)
            return
        self._cut(sid, cached)
        if not self._cells_of.blocks_of(sid):
            self._drop(sid)
            return
        while len(self._kept) >= self.max_kept:
            self._drop(next(iter(self._kept)))
        kept = self._free_kept.pop()
        self.lib.llama_memory_seq_cp(self.memory, sid, kept, -1, -1)  # its cells, retagged
        self.lib.llama_memory_seq_rm(self.memory, sid, -1, -1)
        self._cells_of.rename(sid, kept)
        heapq.heappush(self._free_ids, sid)
        self._kept[kept] = None

    # ---- sequences ---------------------------------------------------------------

    def _seq_id(self, session_id: str) -> int:
        sid = self._seq_ids.get(session_id)
        if sid is None:
            if not self._free_ids:
                raise RuntimeError(
                    f"all {self.options.max_sequences} llama.cpp sequences are in use"
                )
            sid = self._seq_ids[session_id] = heapq.heappop(self._free_ids)
            self._ends[sid] = 0
        return sid

    def _compact(self) -> None:
        """With streams: while an id below the highest live one is free, move the highest
        live sequence there (`llama_memory_seq_cp` across streams: llama.cpp copies the
        stream's buffers at the start of the next decode; a stream of SmolLM2's 512
        cells is 11.8 MB), so the live ids stay consecutive and a tick stays one ubatch
        (a gap would cut every later tick in two forwards, each reading the weights).
        Only after an id was freed: ids are handed out lowest first, so no gap opens
        otherwise."""
        self._freed = False
        while self._free_ids and self._seq_ids:
            low = self._free_ids[0]
            session, high = max(self._seq_ids.items(), key=lambda item: item[1])
            if high < low:
                return
            heapq.heapreplace(self._free_ids, high)
            self.lib.llama_memory_seq_cp(self.memory, high, low, -1, -1)
            self.lib.llama_memory_seq_rm(self.memory, high, -1, -1)
            self._seq_ids[session] = low
            self._ends[low] = self._ends.pop(high)
            self.moved += 1

    def _place(self, sid: int, entry: DecodeStep | PrefillChunk, start: int) -> None:
        """Make the sequence's cells end at `start`, where this tick feeds it from, and
        mark the blocks the entry writes as its own.

        Past its end: a prefix the engine's cache supplied (whole blocks of the entry's
        table): each block's cells are lent by a sequence that holds them
        (`llama_memory_seq_cp`: the cells gain this sequence's tag, nothing is copied),
        or, where none does any more (a kept sequence was dropped), computed again
        from the session's own tokens. Before its end: a tick fed again (a retry)."""
        end, size, table = self._ends[sid], self._block_size, entry.block_table
        if end > start:
            self._cut(sid, start)
        elif end < start:
            if end % size or start % size or not self._spec.shares_prefix:
                raise RuntimeError(
                    f"llama.cpp sequence {sid} holds positions up to {end}, the plan "
                    f"feeds from {start} (a prefix this runner does not have)"
                )
            lost: list[int] = []  # leading positions of blocks nobody holds, in order
            for first in range(end, start, size):
                block = table[first // size]
                lender = self._cells_of.holder(block, first)
                if lender is None:
                    lost.append(first)
                    continue
                self._recompute(sid, entry.seq, lost)
                lost = []
                self.lib.llama_memory_seq_cp(self.memory, lender, sid, first, first + size)
            self._recompute(sid, entry.seq, lost)
            for first in range(end, start, size):
                self._cells_of.add(table[first // size], first, sid)
            self._ends[sid] = start
        if not self._spec.shares_prefix:
            return  # no block is lent: nothing to track
        stop = start + (1 if isinstance(entry, DecodeStep) else entry.length)
        for first in range(start - start % size, stop, size):
            for stale in self._cells_of.write(table[first // size], first, sid):
                self._forget(stale)

    def _recompute(self, sid: int, seq: SeqState, firsts: list[int]) -> None:
        """Compute the KV of consecutive blocks starting at `firsts` for the sequence
        (its cells end at firsts[0]), in batches of the runner's size, no logits."""
        if not firsts:
            return
        ids = seq.all_ids
        size = self._block_size
        start, stop = firsts[0], firsts[-1] + size
        cap = len(self._token)
        for at in range(start, stop, cap):
            n = min(cap, stop - at)
            self._token[:n] = ids[at : at + n]
            self._pos[:n] = np.arange(at, at + n, dtype=np.int32)
            self._seq[:n] = sid
            self._flag[:n] = 0
            self._batch.n_tokens = n
            code = int(self.lib.llama_decode(self.ctx, self._batch))
            if code != 0:
                self._cut(sid, start)
                raise RuntimeError(
                    f"llama_decode failed recomputing a dropped prefix: {code} "
                    f"({_DECODE_ERRORS.get(code, 'error')})"
                )
        self.recomputed_tokens += stop - start
        self._recomputed[seq.session_id] = self._recomputed.get(seq.session_id, 0) + stop - start

    def _cut(self, sid: int, start: int) -> None:
        """Remove the sequence's cells from `start` on."""
        self.lib.llama_memory_seq_rm(self.memory, sid, start, -1)
        if sid in self._ends:
            self._ends[sid] = start
        self._cells_of.cut(sid, start)

    def _forget(self, stale: tuple[int, int]) -> None:
        """A block was written again: the cells a kept sequence held of its previous
        contents go (so llama.cpp's cells in use stay within the block pool)."""
        sid, first = stale
        self.lib.llama_memory_seq_rm(self.memory, sid, first, first + self._block_size)
        if sid in self._kept and not self._cells_of.blocks_of(sid):
            self._drop(sid)

    def _drop(self, sid: int) -> None:
        """Remove every cell of the sequence and free its id."""
        self.lib.llama_memory_seq_rm(self.memory, sid, -1, -1)
        self._cells_of.remove(sid)
        if sid in self._kept:
            del self._kept[sid]
            self._free_kept.append(sid)
        else:
            heapq.heappush(self._free_ids, sid)
            self._freed = bool(self.stream_cells)

    def close(self) -> None:
        """Free llama.cpp's context and model (a worker that exits need not)."""
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        pool: ThreadPool | None = getattr(self, "pool", None)
        if pool is not None:
            pool.free()  # after the context that computed on it
            self.pool = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None


class _PoolParams(ctypes.Structure):
    """ggml.h's `ggml_threadpool_params`."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * 512),  # GGML_MAX_N_THREADS
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class ThreadPool:
    """A ggml thread pool whose threads sleep between ticks, attached to a context.

    llama.cpp built with OpenMP computes a tick on OpenMP's threads, which spin after it
    (libgomp's default) while the worker's Python sends the tick's Redis round trip, and
    redis-server and the clients that wake for it then find both cores taken: on 2 cores
    the round trip's send took 0.83 ms of wall time against 0.44 without OpenMP
    (bench/redis_overhead.py, EPYC Zen 4), its CPU ~0.2. Built without OpenMP, llama.cpp
    makes and joins its threads every tick unless a pool is attached; this one polls
    for no work between ticks (`poll` 0: its threads wait on a condition variable, woken
    once a tick) and spins only at the barriers within one, as llama.cpp's own do. It
    has `threads` threads; `llama_set_n_threads` may use fewer (the thread governor).

    The pool must come from the copy of ggml's CPU library that libllama computes with
    (`_loaded`): the wheel holds `libggml-cpu.so` and `libggml-cpu.so.0` as two files,
    and a pool made by the other copy runs that copy's code on its own state, which
    knows nothing of the weights libllama's copy repacked (CPU_REPACK, AMX): on it
    Gemma 3's Q4_K_M file gave token 0 every time."""

    def __init__(self, lib: ModuleType, threads: int) -> None:
        import llama_cpp

        folder = Path(llama_cpp.__file__).parent / "lib"
        self._llama = lib._lib
        self._ggml = ctypes.CDLL(str(_loaded(folder, "libggml-cpu")))
        base = ctypes.CDLL(str(_loaded(folder, "libggml-base")))
        params = _PoolParams()
        base.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(_PoolParams), ctypes.c_int]
        base.ggml_threadpool_params_init.restype = None
        base.ggml_threadpool_params_init(ctypes.byref(params), threads)
        params.poll = 0
        self._ggml.ggml_threadpool_new.argtypes = [ctypes.POINTER(_PoolParams)]
        self._ggml.ggml_threadpool_new.restype = ctypes.c_void_p
        self._ggml.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        self._ggml.ggml_threadpool_free.restype = None
        self._llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p] * 3
        self._llama.llama_attach_threadpool.restype = None
        self.handle: int | None = self._ggml.ggml_threadpool_new(ctypes.byref(params))
        if not self.handle:
            raise ModelLoadError(f"ggml could not start a pool of {threads} threads")
        self.threads = threads

    def attach(self, ctx: Any) -> None:
        """Compute `ctx`'s ticks (decode and prompt batches alike) on this pool."""
        self._llama.llama_attach_threadpool(ctx, self.handle, self.handle)

    def free(self) -> None:
        if self.handle:
            self._ggml.ggml_threadpool_free(self.handle)
            self.handle = None


def _loaded(folder: Path, name: str, maps: str = "/proc/self/maps") -> Path:
    """The file of library `name` (e.g. "libggml-cpu") in `folder` that this process has
    already mapped, the one libllama links to; else `name.so.0`, its soname. Opening
    another file of the same library (a wheel keeps `.so`, `.so.0` and `.so.0.x.y` as
    copies, not links) would load a second copy with state of its own. The maps name
    real paths, so the folder is compared resolved (a venv reached through a symlink)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            mapped = [line.split(maxsplit=5)[-1].strip() for line in f if len(line.split()) >= 6]
    except OSError:
        mapped = []
    real = folder.resolve()
    for path in map(Path, mapped):
        if path.name.startswith(f"{name}.so") and path.parent in (folder, real):
            return path
    return folder / f"{name}.so.0"


class BlockCells:
    """Which llama.cpp sequences hold cells of each block of the scheduler's KV pool.

    A block's cells are written by one sequence at positions `first..first+size-1` and
    may be lent to others (a shared prefix: the cells carry every borrower's tag). When
    the engine hands the block out again and a sequence writes it, the holders of its
    previous contents are stale: `write` returns them, and their cells are removed.
    So llama.cpp never holds more than one block's worth of cells per block."""

    def __init__(self) -> None:
        self._first: dict[int, int] = {}  # block -> its first position
        self._holders: dict[int, set[int]] = {}  # block -> sequence ids
        self._blocks: dict[int, set[int]] = {}  # sequence id -> blocks

    def blocks_of(self, sid: int) -> set[int]:
        return self._blocks.get(sid, set())

    def holder(self, block: int, first: int) -> int | None:
        """A sequence holding the block's cells at `first`, or None."""
        holders = self._holders.get(block)
        if not holders or self._first[block] != first:
            return None
        return min(holders)

    def add(self, block: int, first: int, sid: int) -> None:
        """The sequence holds the block's cells at `first` (lent, or computed again)."""
        self._first[block] = first
        self._holders.setdefault(block, set()).add(sid)
        self._blocks.setdefault(sid, set()).add(block)

    def write(self, block: int, first: int, sid: int) -> list[tuple[int, int]]:
        """The sequence writes the block at `first`: (sequence, first position) of each
        holder of the block's previous contents, forgotten here."""
        stale: list[tuple[int, int]] = []
        holders = self._holders.get(block)
        if holders is not None:
            old = self._first[block]
            for holder in sorted(holders):
                if holder != sid or old != first:
                    stale.append((holder, old))
                    self._discard(holder, block)
        self.add(block, first, sid)
        return stale

    def cut(self, sid: int, start: int) -> None:
        """The sequence's cells from `start` on were removed."""
        for block in list(self.blocks_of(sid)):
            if self._first[block] >= start:
                self._discard(sid, block)

    def rename(self, sid: int, new: int) -> None:
        """The sequence's cells now carry the id `new` (and no longer `sid`)."""
        blocks = self._blocks.pop(sid, set())
        for block in blocks:
            holders = self._holders[block]
            holders.discard(sid)
            holders.add(new)
        if blocks:
            self._blocks[new] = blocks

    def remove(self, sid: int) -> None:
        """Every cell of the sequence was removed."""
        for block in list(self.blocks_of(sid)):
            self._discard(sid, block)
        self._blocks.pop(sid, None)

    def _discard(self, sid: int, block: int) -> None:
        holders = self._holders[block]
        holders.discard(sid)
        if not holders:
            del self._holders[block], self._first[block]
        mine = self._blocks.get(sid)
        if mine is not None:
            mine.discard(block)
            if not mine:
                del self._blocks[sid]


def _read_gguf(path: Path) -> tuple[Tokenizer | None, str | None]:
    """tokenfleet's own tokenizer of the file (the torch runner's, so prompts, chat
    templates and detokenizing are the same on both runners) and its weights' type."""
    from tokenfleet.model.gguf import open_gguf, source_quant
    from tokenfleet.model.gguf_tokenizer import tokenizer_from_gguf

    reader = open_gguf(path)
    return tokenizer_from_gguf(reader, path), source_quant(reader)
