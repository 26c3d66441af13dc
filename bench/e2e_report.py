"""bench/e2e.py's output: the tables docs/benchmarks-history.md shows, the terminal table and
the plot, from the results bench/e2e.py writes (one entry per block and code tree)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from report import figure, markdown_table, ms, num, text_table


def labels(b: dict[str, Any], tree: str | None = None) -> tuple[str, str]:
    """(in-process label, through-Redis label) of one block (and tree, when several)."""
    t_in, k, t = b["in_process_flags"]["threads"], b["workers"], b["worker_flags"]["threads"]
    where = f"{tree}: " if tree is not None and len(b["trees"]) > 1 else ""
    return (
        f"{where}in process, {t_in} thread{'s' * (t_in > 1)}",
        f"{where}Redis, {k} worker{'s' * (k > 1)} × {t} thread{'s' * (t > 1)}",
    )


def systems(b: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], bool]]:
    """(label, its summary, the tree's result, through Redis?) per table row of a block."""
    for tree, x in b["trees"].items():
        in_process, through_redis = labels(b, tree)
        yield in_process, x["in_process"], x, False
        yield through_redis, x["through_redis"], x, True


LATENCIES = (
    "ttft_p50_s",
    "ttft_p99_s",
    "queued_p50_s",
    "queued_p99_s",
    "burst_gap_p50_s",
    "burst_gap_p99_s",
)


def markdown(results: dict[str, Any]) -> str:
    """The tables docs/benchmarks-history.md's entries show, generated so no number is
    copied by hand."""
    lines = []
    for name, res in results.items():
        lines += [
            f"**{name}** ({res['params'] / 1e6:.1f}M parameters), {res['requests']} requests, "
            f"{res['useful_tokens']} useful tokens; each block's in-process engine was run in "
            "the same rounds, interleaved.",
            "",
        ]
        rows = []
        for b in res["blocks"].values():
            for label, s, x, redis_row in systems(b):
                lat = [ms(s[key]) for key in LATENCIES]
                rows.append(
                    [
                        label,
                        f"{s['tok_s_best']:.0f} ({s['tok_s_median']:.0f})",
                        f"{x['ratio_best']:.3f} ({x['ratio_median']:.3f})" if redis_row else "",
                        f"{lat[0]} / {lat[1]}",
                        f"{lat[2]} / {lat[3]}",
                        f"{lat[4]} / {lat[5]} ({s['burst_gap_n']})",
                        f"{x['tokens_match']}/{x['tokens_compared']}" if redis_row else "",
                    ]
                )
        header = [
            "system",
            "useful tok/s best (median)",
            "Redis ÷ in process, best (median)",
            "TTFT p50 / p99 ms",
            "queue wait p50 / p99 ms",
            "burst gaps p50 / p99 ms (n)",
            "tokens equal",
        ]
        lines += markdown_table(header, rows)
        lines += [
            "",
            "Where the time went (all-at-once runs, means over rounds): wall time, ticks and "
            "seconds inside `Engine.step` (workers: summed over workers, from their "
            "heartbeats), and CPU seconds used during the Redis runs.",
            "",
        ]
        rows = []
        for b in res["blocks"].values():
            for tree, x in b["trees"].items():
                rs = [r for r in x["per_round"] if r["scenario"] == "all"]
                cpu = {c: statistics.mean(r["cpu_s"][c] for r in rs) for c in rs[0]["cpu_s"]}
                split = sorted(
                    {"+".join(map(str, sorted(r["jobs_by_worker"].values()))) for r in rs}
                )
                rows.append(
                    [
                        labels(b, tree)[1],
                        f"{statistics.mean(x['through_redis']['wall_s']):.3f}",
                        f"{statistics.mean(x['in_process']['wall_s']):.3f}",
                        f"{x['worker_ticks_mean']:.0f}",
                        f"{statistics.mean(x['in_process']['ticks']):.0f}",
                        num(x["worker_step_s_mean"]),
                        f"{x['in_process_step_s_mean']:.3f}",
                        f"{cpu['workers']:.2f} / {cpu['redis_server']:.2f} / {cpu['client']:.2f}",
                        ", ".join(split),
                        f"{b['load_at_start']['loadavg'][0]:.2f} / "
                        f"{b['load_at_end']['loadavg'][0]:.2f}",
                    ]
                )
        header = [
            "block",
            "Redis wall s",
            "in-process wall s",
            "worker ticks",
            "in-process ticks",
            "workers' s in `Engine.step`",
            "in-process s in `Engine.step`",
            "CPU s workers / redis-server / client",
            "jobs per worker",
            "load avg (1 min) at block start / end",
        ]
        lines += markdown_table(header, rows, "lrrrrrrrlr")
        lines += trees_markdown(res)
        costs = ", ".join(
            f"{k.removesuffix('_ms')} {v:.3f}" for k, v in res["redis_costs_ms"].items()
        )
        lines += ["", f"Redis calls from one Python process here, median ms: {costs}.", ""]
    return "\n".join(lines)


def versus_first(b: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(tree, its result, the first tree's result) for every tree after the first."""
    trees = list(b["trees"].items())
    return [(tree, x, trees[0][1]) for tree, x in trees[1:]]


def trees_markdown(res: dict[str, Any]) -> list[str]:
    """With several trees: each one's useful tok/s against the first tree's."""
    rows = []
    for b in res["blocks"].values():
        for tree, x, ref in versus_first(b):
            first = next(iter(b["trees"]))
            rows.append(
                [
                    f"{labels(b)[1]}: {tree} ÷ {first}",
                    *(
                        f"{x[m]['tok_s_best'] / ref[m]['tok_s_best']:.3f} "
                        f"({x[m]['tok_s_median'] / ref[m]['tok_s_median']:.3f})"
                        for m in ("through_redis", "in_process")
                    ),
                    f"{x['tokens_match_first_tree']}/{x['tokens_compared']}",
                ]
            )
    if not rows:
        return []
    header = [
        "block: tree ÷ first tree",
        "through Redis tok/s, best (median)",
        "in process tok/s, best (median)",
        "in-process tokens equal",
    ]
    return ["", "Code trees measured in the same rounds:", "", *markdown_table(header, rows)]


def table(results: dict[str, Any]) -> str:
    lines = []
    header = ["system", "tok/s", "ratio", "med.r", "TTFT50", "TTFT99", "queue50", "queue99"]
    header += ["burst50", "burst99", "match"]
    for name, res in results.items():
        lines.append(f"\n{name} ({res['params'] / 1e6:.1f}M params), {res['useful_tokens']} tokens")
        rows = []
        for b in res["blocks"].values():
            for label, s, x, redis_row in systems(b):
                ratios = [f"{x['ratio_best']:.3f}", f"{x['ratio_median']:.3f}"]
                rows.append(
                    [
                        label,
                        f"{s['tok_s_best']:.0f}",
                        *(ratios if redis_row else ["", ""]),
                        *(ms(s[key]) for key in LATENCIES),
                        f"{x['tokens_match']}/{x['tokens_compared']}" if redis_row else "",
                    ]
                )
        lines += text_table(header, rows)
        for b in res["blocks"].values():
            for tree, x, ref in versus_first(b):
                lines.append(
                    f"{labels(b)[1]}: {tree} ÷ {next(iter(b['trees']))} through Redis "
                    f"{x['through_redis']['tok_s_best'] / ref['through_redis']['tok_s_best']:.3f}"
                    f", in process "
                    f"{x['in_process']['tok_s_best'] / ref['in_process']['tok_s_best']:.3f}"
                )
        lines.append("target: useful tok/s ratio (Redis ÷ in process) >= 0.95; latencies in ms")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    names = list(results)
    with figure(path, 2, len(names), figsize=(8 * len(names), 8), squeeze=False) as axes:
        for col, name in enumerate(names):
            blocks = list(results[name]["blocks"].values())
            trees = list(blocks[0]["trees"])
            ax = axes[0][col]
            x = range(len(blocks))
            width = 0.8 / (2 * len(trees))
            for t, tree in enumerate(trees):
                where = f"{tree}, " if len(trees) > 1 else ""
                offset = -0.4 + width / 2 + 2 * t * width
                ax.bar(
                    [i + offset for i in x],
                    [b["trees"][tree]["in_process"]["tok_s_best"] for b in blocks],
                    width,
                    label=f"{where}in process",
                    color=f"C{7 - t}",
                )
                bars = ax.bar(
                    [i + offset + width for i in x],
                    [b["trees"][tree]["through_redis"]["tok_s_best"] for b in blocks],
                    width,
                    label=f"{where}through Redis",
                    color=f"C{t}",
                )
                ax.bar_label(
                    bars,
                    labels=[f"{b['trees'][tree]['ratio_best']:.2f}×" for b in blocks],
                    fontsize=8,
                )
            ax.set_xticks(
                list(x), [labels(b)[1].removeprefix("Redis, ") for b in blocks], fontsize=8
            )
            top = max(b["trees"][t]["in_process"]["tok_s_best"] for b in blocks for t in trees)
            ax.set_ylim(top=1.25 * top)
            ax.set_ylabel("useful tokens/s (best round)")
            ax.set_title(f"{name}: mixed workload (bar label: Redis ÷ in process)")
            ax.legend(fontsize=8, ncol=2, loc="upper center")
            ax = axes[1][col]
            keys = [
                ("ttft_p50_s", "TTFT p50"),
                ("ttft_p99_s", "TTFT p99"),
                ("burst_gap_p50_s", "burst gap p50"),
                ("burst_gap_p99_s", "burst gap p99"),
            ]
            series: list[tuple[str, dict[str, Any]]] = []
            for tree in trees:
                # each in-process thread count once (its first block), then every Redis block
                firsts = {
                    labels(b, tree)[0]: b["trees"][tree]["in_process"] for b in reversed(blocks)
                }
                series += list(firsts.items())[::-1]
                series += [(labels(b, tree)[1], b["trees"][tree]["through_redis"]) for b in blocks]
            width = 0.8 / len(series)
            for i, (label, s) in enumerate(series):
                ax.bar(
                    [m + i * width for m in range(len(keys))],
                    [1000 * s[k] for k, _ in keys],
                    width,
                    label=label,
                )
            ax.set_xticks(
                [m + width * (len(series) - 1) / 2 for m in range(len(keys))],
                [label for _, label in keys],
            )
            ax.set_ylabel("ms")
            ax.set_title(f"{name}: latency (burst gaps: the 4 sessions in flight)")
            ax.legend(fontsize=7)
