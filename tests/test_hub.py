"""`--model org/name`: a Hugging Face hub id, read offline from a cache laid out here.

The cache is built the way huggingface_hub lays it out (models--org--name/refs/main
naming a snapshot folder of files), and the load runs in a fresh interpreter with
HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at it, so nothing touches the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.models import make_hf_llama
from tokenfleet.model.hub import looks_like_hub_id

REVISION = "0123456789abcdef0123456789abcdef01234567"

LOAD = """
import json, sys
import torch
from tokenfleet.model import load_model
from tokenfleet.errors import ModelLoadError
try:
    loaded = load_model(sys.argv[1], device="cpu")
except ModelLoadError as e:
    print(json.dumps({"error": str(e)}))
else:
    from tokenfleet.model import SeqInput
    pool = loaded.model.new_kv_pool(2, 16)
    logits = loaded.model.forward([5, 6, 7], [SeqInput([0], 0, 3)], pool)
    print(json.dumps({"layers": loaded.config.num_layers, "logits": logits[0, :4].tolist()}))
"""


def _cache(tmp_path: Path) -> tuple[Path, Path]:
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / REVISION
    make_hf_llama(seed=3).save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return cache, snapshot


def _load(name: str, cache: Path) -> dict[str, object]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, name],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_hub_id_loads_offline_from_the_cache(tmp_path: Path) -> None:
    from tokenfleet.model import load_model

    cache, snapshot = _cache(tmp_path)
    got = _load("tiny-org/tiny-llama", cache)
    want = load_model(str(snapshot), device="cpu")
    assert got["layers"] == want.config.num_layers == 2
    from tokenfleet.model import SeqInput

    logits = want.model.forward([5, 6, 7], [SeqInput([0], 0, 3)], want.model.new_kv_pool(2, 16))
    assert got["logits"] == logits[0, :4].tolist()


def test_an_uncached_hub_id_offline_is_a_named_error(tmp_path: Path) -> None:
    cache, _ = _cache(tmp_path)
    got = _load("tiny-org/not-there", cache)
    assert "Hugging Face hub id" in str(got["error"]) and "tiny-org/not-there" in str(got["error"])


def test_what_counts_as_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert looks_like_hub_id("org/name@main")
    assert not looks_like_hub_id("tiny-random")
    assert not looks_like_hub_id("/abs/path")
    assert not looks_like_hub_id("a/b/c")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert not looks_like_hub_id("org/model")  # an existing folder wins
