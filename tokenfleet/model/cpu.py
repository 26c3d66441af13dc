"""What this CPU can do, from its feature flags (a leaf: no tokenfleet imports)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux: /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(flags.split()[2:])  # past "flags" and ":"


def cpu_has_bf16() -> bool:
    """Whether this CPU has AVX512-BF16 or AMX-BF16."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
