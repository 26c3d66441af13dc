"""Code trees: other checkouts of tokenfleet measured beside this one in the same run
(bench/ab_engine.py, e2e.py, band_share.py and priority.py), and the PYTHONPATH and
working directory that make a child process import a tree's tokenfleet. Stdlib only."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve().parent.parent  # this checkout


@dataclass(frozen=True)
class Tree:
    """A checkout whose tokenfleet the workers and engine processes import."""

    name: str
    path: Path

    @classmethod
    def parse(cls, spec: str, name: str = "") -> Tree:
        """NAME=PATH, or PATH (named `name`, else after its folder)."""
        label, _, path = spec.rpartition("=")
        resolved = Path(path).expanduser().resolve()
        if not (resolved / "tokenfleet" / "__init__.py").is_file():
            raise SystemExit(f"tree {spec}: no tokenfleet package in {resolved}")
        return cls(label or name or resolved.name, resolved)

    def env(self) -> dict[str, str]:
        """PYTHONPATH first on the path (run with cwd = the tree: `python -m` puts the
        working directory before it)."""
        rest = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": os.pathsep.join([str(self.path), *([rest] if rest else [])])}

    def describe(self) -> dict[str, Any]:
        """Path, commit and whether the checkout has changes; the tokenfleet its workers
        import (checked: it must be the tree's own)."""
        found = subprocess.run(
            [sys.executable, "-c", "import tokenfleet; print(tokenfleet.__file__)"],
            capture_output=True,
            text=True,
            check=True,
            cwd=self.path,
            env={**os.environ, **self.env()},
        ).stdout.strip()
        if not Path(found).resolve().is_relative_to(self.path):
            raise SystemExit(f"tree {self.name}: workers would import {found}, not {self.path}")

        def git(*args: str) -> str:
            proc = subprocess.run(
                ["git", "-C", str(self.path), *args], capture_output=True, text=True, check=False
            )
            return proc.stdout.strip()

        return {
            "path": str(self.path),
            "commit": git("rev-parse", "--short", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "tokenfleet": found,
        }


def parse_trees(specs: list[str], default: str = "this") -> list[Tree]:
    """The trees of repeated NAME=PATH arguments (names must differ); none: this checkout."""
    trees = [Tree.parse(spec) for spec in specs] or [Tree(default, THIS)]
    names = [t.name for t in trees]
    if len(set(names)) != len(names):
        raise SystemExit(f"tree names must differ: {names}")
    return trees
