"""The package's import graph has no cycle, and its packages are layered: each imports
only from layers below its own (lazy imports inside functions count too; imports only
for type checking do not).

`LAYERS` is the one place the order is written, lowest first. A new module or package
of `tokenfleet` must be placed in it; docs/architecture.md draws the same floors."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenfleet

ROOT = Path(tokenfleet.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    mods: dict[str, tuple[Path, bool]] = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for sub in node.body for n in ast.walk(sub))
    return skip


LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "reasons"),  # names only
    ("keys", "redis_errors", "backoff", "connect"),  # where things live, how Redis fails
    ("lua", "protocol", "fleet", "kv"),  # the wire, the fleet's view, KV bookkeeping
    ("seam", "admission", "acl", "tenants", "config"),  # contracts, budgets, settings
    ("model",),  # torch models and the torch runner (implements the seam)
    ("grammar", "tools", "producer", "status", "local"),  # structured output, tools, clients
    ("openai", "deadletters", "worker"),  # OpenAI shapes (no web framework), the worker
    ("batch", "demo", "integrations"),  # the Batch API's runner and store, the demo
    ("gateway",),  # the HTTP front
    ("cli",),  # the command line
)


def package_of(module: str) -> str:
    """`tokenfleet.worker.loop` -> `worker`; `tokenfleet.keys` -> `keys`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_edges(
    graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]
) -> list[tuple[str, str]]:
    """Imports from a package to one in its own or a higher layer (or an unplaced one)."""
    level = {name: i for i, names in enumerate(layers) for name in names}
    bad = []
    for mod, targets in graph.items():
        src = package_of(mod)
        if not src:
            continue
        for target in targets:
            dst = package_of(target)
            if not dst or dst == src:
                continue
            if src not in level or dst not in level or level[dst] >= level[src]:
                bad.append((mod, target))
    return sorted(bad)


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    src = ".".join([*base, *([node.module] if node.module else [])])
                # `from pkg import sub` imports pkg.sub; `from mod import name`, mod
                targets = [
                    f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names
                ]
            for target in targets:
                found = resolve(target) if target.startswith("tokenfleet") else None
                if found and found != mod:
                    graph[mod].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_tokenfleet_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "tokenfleet.worker.engine" in graph and graph["tokenfleet.cli"]
    assert cycles(graph) == []


def test_the_checker_finds_an_upward_import() -> None:
    layers = (("low",), ("mid_a", "mid_b"), ("high",))
    graph = {
        "tokenfleet.high.x": {"tokenfleet.low", "tokenfleet.mid_a.y"},
        "tokenfleet.mid_a.y": {"tokenfleet.low", "tokenfleet.mid_a.z"},  # own package: fine
        "tokenfleet.mid_b": {"tokenfleet.mid_a.y"},  # same layer: refused
        "tokenfleet.low": {"tokenfleet.high.x"},  # up: refused
        "tokenfleet.new.w": {"tokenfleet.low"},  # not placed: refused
    }
    assert upward_edges(graph, layers) == [
        ("tokenfleet.low", "tokenfleet.high.x"),
        ("tokenfleet.mid_b", "tokenfleet.mid_a.y"),
        ("tokenfleet.new.w", "tokenfleet.low"),
    ]


def test_every_package_is_placed_in_a_layer() -> None:
    placed = {name for names in LAYERS for name in names}
    packages = {package_of(m) for m in import_graph()} - {""}
    assert packages - placed == set(), "place it in LAYERS"
    assert placed - packages == set(), "a layer names what no longer exists"


def test_packages_only_import_from_lower_layers() -> None:
    graph = import_graph()
    assert "tokenfleet.model.torch_runner" in graph and "tokenfleet.seam" in graph
    assert upward_edges(graph, LAYERS) == []
