"""The CPU paged decode-attention kernel (`paged_cpu.cpp`), built on first use.

`load()` compiles the C++ file with torch's cpp_extension (gcc, -O3 -march=native;
~40 s the first time, then a cached .so under ~/.cache/tokenfleet/ext keyed by the
source and the CPU), loads it as `torch.ops.tokenfleet.decode_attention` (and the
int8 x int8 and int4 x int8 matmuls, `torch.ops.tokenfleet.int8_linear` and `q4_linear`,
that `model/quant.py` uses),
and gives the ops shape-only ("fake") implementations so compiled graphs can call them. It
returns False, with the reason in `failure()`, where no compiler is at hand: callers
then keep the portable SDPA path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("paged_cpu.cpp")
_failure: str | None = None


def _build_dir() -> Path:
    from tokenfleet.model.cpu import cpu_flags  # -march=native: one build per CPU kind

    text = SOURCE.read_bytes() + torch.__version__.encode() + platform.processor().encode()
    digest = hashlib.blake2b(text + " ".join(sorted(cpu_flags())).encode(), digest_size=8)
    root = Path(os.environ.get("TOKENFLEET_EXT_DIR", Path.home() / ".cache" / "tokenfleet" / "ext"))
    return root / f"paged_cpu-{digest.hexdigest()}"


@functools.cache
def load() -> bool:
    """Build (once per machine) and register the kernel; False where it cannot be."""
    global _failure
    try:
        from torch.utils.cpp_extension import load as build

        folder = _build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        build(
            name="tokenfleet_paged_cpu",
            sources=[str(SOURCE)],
            build_directory=str(folder),
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-lmvec", "-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: stay portable
        _failure = f"{type(exc).__name__}: {exc}"[:300]
        return False

    @torch.library.register_fake("tokenfleet::decode_attention")  # type: ignore[untyped-decorator]
    def _(q: Tensor, *rest: object) -> Tensor:  # the output's shape: q's
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("tokenfleet::int8_linear")  # type: ignore[untyped-decorator]
    def _int8(x: Tensor, w: Tensor, scales: Tensor, n: int) -> Tensor:  # [M, n] bf16
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("tokenfleet::q4_linear")  # type: ignore[untyped-decorator]
    def _q4(x: Tensor, w: Tensor, dm: Tensor, n: int) -> Tensor:  # [M, n] bf16
        return x.new_empty((x.shape[0], n))

    return True


def enabled() -> bool:
    """Whether eager decode rows use the kernel too (the decode graph always does):
    only with `TOKENFLEET_PAGED_ATTENTION=1`. Off by default: its rounding differs from
    SDPA's, and a prompt's last token attended as a decode row (after a prefix-cache hit)
    must round as it does inside a prefill chunk for a repeated request to give the same
    bits; and it measured no faster than gather + SDPA on wide dense ticks (16 rows)."""
    return os.environ.get("TOKENFLEET_PAGED_ATTENTION", "0") == "1" and load()


def failure() -> str | None:
    """Why `load()` returned False (None when it did not)."""
    return _failure


def decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    k_new: Tensor | None,
    v_new: Tensor | None,
    tables: Tensor,
    past: Tensor,
    layer: int,
    block_size: int,
    window: int = 0,
) -> Tensor:
    """q [B, H, hd] over each row's `past` keys in layer `layer` of the pools [layers,
    S, KVH, hd] (through its int32 block table row), plus its own k/v_new [B, KVH, hd]
    when given -> [B, H, hd]. `window` > 0: the sliding window of that many positions."""
    out: Tensor = torch.ops.tokenfleet.decode_attention(
        q, k_pool, v_pool, k_new, v_new, tables, past, layer, block_size, window
    )
    return out
