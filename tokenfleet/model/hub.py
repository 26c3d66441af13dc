"""Hugging Face hub ids as `--model`: `org/name` resolves to a local snapshot folder.

Online, `huggingface_hub` downloads what a checkpoint needs (config, safetensors,
tokenizer and template files) into its cache; offline (`HF_HUB_OFFLINE=1`, or no
network) the files already in the cache are used. Either way the loader then
reads an ordinary folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from tokenfleet.errors import ModelLoadError

# What a checkpoint folder needs; nothing else of a repo is fetched.
CHECKPOINT_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}(@[\w./-]+)?$")


def looks_like_hub_id(name: str) -> bool:
    """`org/name` or `org/name@revision`, and not a path that exists here."""
    return _HUB_ID.match(name) is not None and not Path(name).exists()


def resolve_hub_id(name: str) -> Path:
    """The local snapshot folder of hub id `name` (downloaded, or from the cache)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = name.partition("@")
    try:
        folder = snapshot_download(
            repo_id, revision=revision or None, allow_patterns=CHECKPOINT_FILES
        )
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(
            f"{name!r} is not a checkpoint folder here, and as a Hugging Face hub id it is"
            f" neither in the local cache nor downloadable (offline, or the hub is"
            f" unreachable): {e}"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelLoadError(f"cannot fetch {name!r} from the Hugging Face hub: {e}") from e
    return Path(str(folder))
