"""What every benchmark reports the same way: where and under what load it ran (`Run`),
summaries of repeated measurements, tables for the terminal and for docs/benchmarks-history.md,
its command line's output flags, the JSON (and .md) it writes, and its matplotlib figures.

Imports nothing heavy: the gateway benchmark, which never loads torch, uses it too.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

# ---- where it ran ---------------------------------------------------------------------


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def load_now() -> dict[str, Any]:
    """Load average and the share of the last 60 s some task waited for a CPU (Linux PSI)."""
    pressure = None
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()
        pressure = float(dict(f.split("=") for f in some[1:])["avg60"])
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return {"loadavg": loadavg(), "cpu_pressure_avg60": pressure}


def package_version(package: str) -> str | None:
    """The installed version of `package` (from its metadata: nothing is imported)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """The machine, library versions, thread settings and load when a run starts.

    `torch_threads` is read only if torch is imported already (the caller set its
    threads); versions come from package metadata, so nothing is imported here."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    torch = sys.modules.get("torch")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_"))},
        "loadavg_at_start": loadavg(),
        "load_at_start": load_now(),
    }


def mark_end(machine: dict[str, Any]) -> dict[str, Any]:
    """`machine` with the load at the end of the run (call again after each partial write)."""
    machine["loadavg_at_end"] = loadavg()
    machine["load_at_end"] = load_now()
    return machine


def progress(started: float | None = None) -> Callable[[str], None]:
    """A logger that prints each line after the seconds since `started` (default: now)."""
    t0 = time.perf_counter() if started is None else started

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", flush=True)

    return log


class Run:
    """One benchmark run: the machine when it started, its clock and its progress log.

    Made after the caller set torch's threads (`machine_info` reads them)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.machine = machine_info()
        self.log = progress(self.started)

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def report(self, **fields: Any) -> dict[str, Any]:
        """`fields` after "machine" (with the load now) and before "wall_s" (so far)."""
        return {"machine": mark_end(self.machine), **fields, "wall_s": self.wall_s}

    def finish(
        self,
        args: argparse.Namespace,
        report: dict[str, Any],
        markdown: str | None = None,
        plot: Callable[[Path], None] | None = None,
        table: str | None = None,
    ) -> Path:
        """The end of the run: `table` printed, the report written to --out (and its
        markdown beside it), the figure drawn when --plot names a file, the closing line
        printed."""
        if table is not None:
            print(table)
        out = write_report(Path(args.out), report, markdown)
        plot_path = getattr(args, "plot", None) if plot is not None else None
        if plot is not None and plot_path:
            plot(Path(plot_path))
        print(wrote(out, plot_path or None, report["wall_s"], markdown is not None))
        return out


# ---- summaries ------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """min / median / max (and n) of repeated measurements; NaN when there are none."""
    if not values:
        return {"min": math.nan, "median": math.nan, "max": math.nan, "n": 0}
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "n": len(values),
    }


def spreads(records: Sequence[Mapping[str, Any]], fields: Iterable[str]) -> dict[str, Any]:
    """`spread` of each field over the records (one record per round)."""
    return {f: spread([r[f] for r in records]) for f in fields}


def mean_or_none(values: Iterable[float | None]) -> float | None:
    """The mean, or None when any value is missing (a counter some run could not read)."""
    got = list(values)
    if not got or any(v is None for v in got):
        return None
    return statistics.mean(v for v in got if v is not None)


# ---- tables ---------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds with one decimal; 'n/a' when unknown."""
    return "n/a" if seconds is None or math.isnan(seconds) else f"{1000 * seconds:.1f}"


def num(value: float | None, fmt: str = ".3f") -> str:
    """A number in `fmt`; 'n/a' when unknown."""
    return "n/a" if value is None or math.isnan(value) else format(value, fmt)


def spread_cells(
    stats: Mapping[str, float] | None, fmt: str = ".1f", scale: float = 1.0
) -> list[str]:
    """A spread's median, min and max (times `scale`) as three cells; 'n/a' when unknown."""
    if stats is None:
        return ["n/a"] * 3
    return [num(stats[k] * scale, fmt) for k in ("median", "min", "max")]


def spread_cell(stats: Mapping[str, float], fmt: str = ".3g", scale: float = 1.0) -> str:
    """A spread as one cell: 'median (min–max)'."""
    median, low, high = spread_cells(stats, fmt, scale)
    return f"{median} ({low}–{high})"


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None
) -> list[str]:
    """A GitHub markdown table, one string per line. `align`: 'l' or 'r' per column
    (default: the first column left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    assert len(align) == len(header), (align, header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for row in rows:
        assert len(row) == len(header), row
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return lines


def markdown_text(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table as text, ending in a newline."""
    return "\n".join(markdown_table(header, rows)) + "\n"


def text_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None
) -> list[str]:
    """Columns padded to their widest cell, for the terminal; `align` as markdown_table."""
    cells = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    align = align or "l" + "r" * (len(header) - 1)
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(row, widths, align, strict=True)
        ).rstrip()
        for row in cells
    ]


# ---- command line and files ------------------------------------------------------------


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, its description the first paragraph of the script's docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def outputs(parser: argparse.ArgumentParser, name: str, plot: bool = True) -> None:
    """--out bench/out/NAME.json and (with `plot`) --plot docs/img/NAME.png."""
    parser.add_argument("--out", default=f"bench/out/{name}.json")
    if plot:
        parser.add_argument("--plot", default=f"docs/img/{name}.png")


def write_json(path: Path, data: Any) -> Path:
    """`data` as indented JSON at `path` (parent folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def write_report(path: Path, report: Any, markdown: str | None = None) -> Path:
    """The JSON report at `path` and, when given, its markdown tables beside it (.md)."""
    write_json(path, report)
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown)
    return path


def wrote(out: Path, plot: Path | str | None, wall_s: float, markdown: bool = True) -> str:
    """The closing line of a run: what it wrote, in how long."""
    extra = " (+ .md tables)" if markdown else ""
    return f"\nwrote {out}{extra}{f' and {plot}' if plot else ''} in {wall_s:.0f} s"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def spread_errors(
    stats: Sequence[Mapping[str, float]],
) -> tuple[list[float], list[list[float]]]:
    """Medians and their [below, above] distances to min and max: a bar chart's values
    and its yerr (xerr)."""
    medians = [s["median"] for s in stats]
    low = [m - s["min"] for m, s in zip(medians, stats, strict=True)]
    high = [s["max"] - m for m, s in zip(medians, stats, strict=True)]
    return medians, [low, high]


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay out, save (parent folders made) and close a figure; `--plot ''` (a path of
    no name) closes it unsaved, where matplotlib would write `.png` in the working folder."""
    if path.name:
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


@contextmanager
def figure(path: Path, *grid: int, **options: Any) -> Iterator[Any]:
    """The axes of `pyplot.subplots(*grid, **options)` (their `.figure` is the figure),
    saved to `path` at the end."""
    fig, axes = pyplot().subplots(*grid, **options)
    yield axes
    save_figure(fig, path)
