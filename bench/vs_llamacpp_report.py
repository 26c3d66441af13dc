"""bench/vs_llamacpp.py's output: its tables (for the terminal and, as markdown, beside the
JSON) and its plot, from the report it writes."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report import figure, num, spread_cells, spread_errors


def speed_tables(
    summary: dict[str, Any], s: dict[str, Any]
) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) per scenario; `s`: the run's settings."""
    b, p, n = s["multi"]
    (p_lo, p_hi), (n_lo, n_hi) = s["mixed_prompt"], s["mixed_new"]
    titles = {
        "one": f"one stream: {s['one'][0]} prompt + {s['one'][1]} new tokens; generation "
        "tok/s (first to last token) and end to end",
        "multi": f"{b} streams: {b} x ({p} prompt + {n} new) at once; aggregate generated "
        "tok/s (prefill included)",
        "mixed": f"mixed: {s['mixed_n']} jobs at once, prompts {p_lo}-{p_hi}, new "
        f"{n_lo}-{n_hi}; useful tok/s, TTFT",
    }
    tables = []
    for scenario, systems in summary.items():
        rows = []
        if scenario == "one":
            header = ["system", "gen tok/s med", "min", "max", "e2e tok/s med"]
            for system, m in systems.items():
                rows.append(
                    [system, *spread_cells(m.get("decode_tok_s")), num(m["tok_s"]["median"], ".1f")]
                )
        elif scenario == "multi":
            header = ["system", "tok/s med", "min", "max", "decode-only tok/s med"]
            for system, m in systems.items():
                dec = m.get("decode_tok_s")
                rows.append(
                    [system, *spread_cells(m["tok_s"]), num(dec["median"], ".1f") if dec else ""]
                )
        else:
            header = ["system", "tok/s med", "min", "max", "TTFT p50 ms", "TTFT p99 ms"]
            for system, m in systems.items():
                rows.append(
                    [
                        system,
                        *spread_cells(m["tok_s"]),
                        num(1000 * m["ttft_p50_s"]["median"], ".0f"),
                        num(1000 * m["ttft_p99_s"]["median"], ".0f"),
                    ]
                )
        tables.append((titles[scenario], header, rows))
    return tables


def ratio_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = [
        "ours",
        "vs llama.cpp",
        "one: gen (server)",
        "one: gen (bb)",
        "multi (server)",
        "multi (bb)",
        "mixed tok/s",
        "mixed TTFT p50",
    ]
    body = [
        [
            r["ours"],
            r["versus"],
            *(
                num(r[k], ".2f") + "x"
                for k in (
                    "one_decode_vs_server",
                    "one_decode_vs_batched_bench",
                    "multi_vs_server",
                    "multi_vs_batched_bench",
                    "mixed_vs_server",
                    "mixed_ttft_p50_server_over_ours",
                )
            ),
        ]
        for r in rows
    ]
    return header, body


def quality_table(
    quality: dict[str, Any], ppl: dict[str, Any]
) -> tuple[list[str], list[list[str]]]:
    header = ["system", "greedy tokens = fp32", "first divergence", "PPL", "+/-", "windows"]
    names = list(dict.fromkeys([*quality["systems"], *ppl["systems"]]))
    rows = []
    for name in names:
        q = quality["systems"].get(name)
        p = ppl["systems"].get(name)
        rows.append(
            [
                name,
                f"{q['identical_frac']:.1%}" if q else "",
                ",".join("-" if d is None else str(d) for d in q["first_divergence"]) if q else "",
                num(p["ppl"], ".4f") if p else "",
                num(p["ppl_err"], ".4f") if p else "",
                str(p["windows"]) if p else "",
            ]
        )
    return header, rows


def round_lines(rounds: list[dict[str, Any]]) -> list[str]:
    return [
        f"round {r['round'] + 1}: {' then '.join(r['order'])}, {r['seconds']:.0f} s, "
        f"load avg {r['load_start']['loadavg'][0]:.2f} -> {r['load_end']['loadavg'][0]:.2f}, "
        f"CPU pressure avg60 {num(r['load_end']['cpu_pressure_avg60'], '.1f')}%"
        for r in rounds
    ]


def render(report: dict[str, Any], table: Callable[..., list[str]]) -> list[str]:
    lines: list[str] = []
    for title, header, rows in speed_tables(report["summary"], report["settings"]):
        lines += ["", title, "", *table(header, rows)]
    if report["ratios"]:
        header, rows = ratio_table(report["ratios"])
        lines += [
            "",
            "ratios of medians (ours / llama.cpp; TTFT: llama.cpp / ours; > 1: ours "
            "better; bb = llama-batched-bench)",
            "",
            *table(header, rows),
        ]
    header, rows = quality_table(report["quality"], report["perplexity"])
    p = report["perplexity"]
    lines += [
        "",
        f"quality: greedy tokens vs tokenfleet fp32 ({report['quality']['new_tokens']} new x "
        f"{len(report['quality']['prompts'])} prompts); perplexity, ctx {p['ctx']}, second "
        f"half of each window scored, {p['tokens_tokenfleet']} text tokens",
        "",
        *table(header, rows),
        "",
        *round_lines(report["rounds"]),
    ]
    if report["notes"]:
        lines += ["", "notes:", *(f"- {n}" for n in report["notes"])]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    summary = report["summary"]
    panels = [
        ("one", "decode_tok_s", "one stream: generation tok/s"),
        ("multi", "tok_s", f"{report['settings']['multi'][0]} streams: aggregate tok/s"),
        ("mixed", "tok_s", "mixed: useful tok/s"),
    ]
    with figure(path, 1, 4, figsize=(20, 5.5)) as axes:
        for ax, (scenario, metric, title) in zip(axes, panels, strict=False):
            systems = [k for k, v in summary.get(scenario, {}).items() if metric in v]
            med, errors = spread_errors([summary[scenario][k][metric] for k in systems])
            colors = [
                "C0" if k.startswith("tokenfleet") else "C1" if "server" in k else "C2"
                for k in systems
            ]
            bars = ax.barh(systems, med, xerr=errors, color=colors, capsize=3)
            ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=4)
            ax.invert_yaxis()
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("tokens/s (median, min-max over rounds)")
            ax.tick_params(axis="y", labelsize=8)
            ax.grid(axis="x", alpha=0.3)
        ax = axes[3]
        ppl = report["perplexity"]["systems"]
        names = list(ppl)
        values = [ppl[k]["ppl"] for k in names]
        bars = ax.barh(
            names, values, color=["C0" if k.startswith("tokenfleet") else "C1" for k in names]
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=8, padding=4)
        if values:  # the variants differ by far less than PPL itself: zoom in
            least, most = min(values), max(values)
            pad = max(most - least, 0.01 * most)
            ax.set_xlim(least - pad, most + pad)
        err = max((ppl[k]["ppl_err"] for k in names), default=math.nan)
        ax.invert_yaxis()
        ax.set_title(
            f"perplexity, ctx {report['perplexity']['ctx']}, lower is better\n"
            f"(same tokens for all; the +/- over tokens: {err:.2f})",
            fontsize=9,
        )
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
        load = [r["load_start"]["loadavg"][0] for r in report["rounds"]]
        ax.figure.suptitle(
            f"tokenfleet vs llama.cpp, SmolLM2-135M-Instruct, {report['threads']} threads, "
            f"{len(report['rounds'])} rounds, load avg {min(load):.2f}-{max(load):.2f}"
            + (" (quick)" if report["quick"] else ""),
            fontsize=11,
        )
