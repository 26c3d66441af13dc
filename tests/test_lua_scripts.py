"""Every Lua script in the package is declared in one place (tokenfleet.lua.SCRIPTS)."""

from __future__ import annotations

from pathlib import Path

import tokenfleet.lua as lua


def test_every_lua_file_is_declared_and_every_declaration_has_its_file() -> None:
    folder = Path(lua.__file__).parent
    files = {p.stem for p in folder.glob("*.lua")}
    # owned_entry.lua holds shared functions, prepended to the scripts that act on an entry.
    assert files - {"owned_entry"} == set(lua.SCRIPTS)
    for name in ("accept", "tick", "dead_letter", "redeliver", "requeue"):
        assert lua.SCRIPTS[name].startswith((folder / "owned_entry.lua").read_text())
