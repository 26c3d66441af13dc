"""Every Lua script tokenfleet runs, declared once: name → source, read from the .lua
files beside this module (each starts with its KEYS/ARGV header).

owned_entry.lua is not a script: it holds the owner check and the helpers of the
scripts that act on a jobs-stream entry a worker owns (accept, tick, dead_letter,
redeliver, requeue), and is prepended to each of them here. Callers register the text they
need (`client.register_script(TICK_LUA)`) and build its KEYS and ARGV with the script's
call in `tokenfleet.lua.calls`; nothing else reads tokenfleet/lua/.
"""

from __future__ import annotations

from importlib import resources
from types import MappingProxyType


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(f"{name}.lua").read_text()


_OWNED_ENTRY = _read("owned_entry")

SUBMIT_LUA = _read("submit")  # producers: accept one job into its capped jobs stream
ACCEPT_LUA = _OWNED_ENTRY + _read("accept")  # worker: check entries just read, mark them running
TICK_LUA = _OWNED_ENTRY + _read("tick")  # worker: one tick's fenced writes for every held job
DEAD_LETTER_LUA = _OWNED_ENTRY + _read("dead_letter")  # worker: dead-letter an owned entry
REDELIVER_LUA = _OWNED_ENTRY + _read("redeliver")  # worker: count an in-process retry
REQUEUE_LUA = _OWNED_ENTRY + _read("requeue")  # worker: put a job it can't start back
PULL_LUA = _read("pull")  # worker: read new entries, highest band first, with the guard
CLAIM_ORPHANS_LUA = _read("claim_orphans")  # worker: take over the entries of dead workers
PROBE_LUA = _read("probe")  # worker: at start, which of its commands its ACL user may not run
LEASE_LUA = _read("lease")  # gateway: take, renew or release a batch's lease

SCRIPTS = MappingProxyType(
    {
        "submit": SUBMIT_LUA,
        "accept": ACCEPT_LUA,
        "tick": TICK_LUA,
        "dead_letter": DEAD_LETTER_LUA,
        "redeliver": REDELIVER_LUA,
        "requeue": REQUEUE_LUA,
        "pull": PULL_LUA,
        "claim_orphans": CLAIM_ORPHANS_LUA,
        "probe": PROBE_LUA,
        "lease": LEASE_LUA,
    }
)

__all__ = [
    "ACCEPT_LUA",
    "CLAIM_ORPHANS_LUA",
    "DEAD_LETTER_LUA",
    "LEASE_LUA",
    "PROBE_LUA",
    "PULL_LUA",
    "REDELIVER_LUA",
    "REQUEUE_LUA",
    "SCRIPTS",
    "SUBMIT_LUA",
    "TICK_LUA",
]
