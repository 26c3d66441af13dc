"""bench/engine.py's output: the tables docs/benchmarks-history.md's entries show (and the
terminal shows the same, plus the targets), and the plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from _engine import MiB
from report import figure, markdown_table, text_table

SWEEP_HEADER = [
    "sessions",
    "tokenfleet tok/s",
    "serialized tok/s",
    "batched ÷ serialized",
    "transformers `generate` tok/s",
    "its batch-N ÷ batch-1",
    "ticks",
    "mean occupancy",
    "peak KV",
    "forward-only tok/s",
    "engine overhead",
]


def render(results: dict[str, Any], table: Callable[..., list[str]]) -> list[str]:
    """Per config: the concurrency sweep and the mixed workload, as `table` draws them."""
    lines = []
    for name, res in results.items():
        lines += [
            f"**{name}** ({res['params'] / 1e6:.1f}M parameters), prompt/new tokens per session "
            "as in the settings; tokens/s are generated tokens per wall second.",
            "",
        ]
        rows = [
            [
                x["concurrency"],
                f"{x['batched_tok_s']:.0f}",
                f"{x['serialized_tok_s']:.0f}",
                f"{x['batched_over_serialized']:.2f}×",
                f"{x['hf_generate_tok_s']:.0f}",
                f"{res['hf_batched_ratio'][str(x['concurrency'])]:.2f}×",
                x["ticks"],
                f"{x['occupancy_mean']:.2f}",
                f"{x['peak_kv_bytes'] / MiB:.2f} MiB",
                f"{x['tokens'] / x['forward_only_s']:.0f}",
                f"{x['overhead_frac']:.1%}",
            ]
            for x in res["sweep"]
        ]
        lines += table(SWEEP_HEADER, rows, "r" * len(SWEEP_HEADER))
        m = res["mixed"]
        ours = m["systems"]["tokenfleet"]["tok_s"]
        lines += [
            "",
            f"Mixed workload: {m['requests']} requests, {m['useful_tokens']} useful tokens "
            f"(the static batch generates {m['static_batch_generated_tokens']}).",
            "",
        ]
        rows = [
            [k, f"{v['tok_s']:.0f}", f"{v['s']:.2f}", f"{ours / v['tok_s']:.2f}×"]
            for k, v in m["systems"].items()
        ]
        lines += table(["system", "useful tok/s", "seconds", "tokenfleet is"], rows)
        lines += [
            "",
            f"tokenfleet ticks {m['ticks']}, engine overhead over bare forwards "
            f"{m['bound']['overhead_frac']:.1%}; greedy tokens equal to one `generate` per "
            f"request: tokenfleet {m['match_tokenfleet_vs_generate']}/{m['requests']}, "
            f"transformers static batch {m['match_hf_static_vs_generate']}/{m['requests']}, "
            f"its continuous batching {m['match_hf_continuous_vs_generate']}/{m['requests']}.",
            "",
        ]
    return lines


def markdown(results: dict[str, Any]) -> str:
    """The tables docs/benchmarks-history.md's entries show, generated so no number is
    copied by hand."""
    return "\n".join(render(results, markdown_table))


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def table(results: dict[str, Any]) -> str:
    """The same tables for the terminal, and each config's targets."""
    lines = render(results, text_table)
    for name, res in results.items():
        t = res["targets"]
        lines.append(
            f"{name} targets: ratio@{t['at_concurrency']} {t['batched_over_serialized']:.2f} vs "
            f"hf {t['hf_batched_over_batch1']:.2f} ({verdict(t['ratio_met'])}); "
            f"mixed {t['mixed_vs_hf_continuous']:.2f}x cb "
            f"({verdict(t['mixed_vs_hf_continuous_met'])}), "
            f"{t['mixed_vs_hf_static']:.2f}x static ({verdict(t['mixed_vs_hf_static_met'])}); "
            f"overhead {t['overhead_frac']:.1%} ({verdict(t['overhead_met'])})"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    names = list(results)
    with figure(path, 2, len(names), figsize=(5.5 * len(names), 8), squeeze=False) as axes:
        for col, name in enumerate(names):
            res = results[name]
            n = [x["concurrency"] for x in res["sweep"]]
            ax = axes[0][col]
            ax.plot(n, [x["batched_tok_s"] for x in res["sweep"]], "o-", label="tokenfleet batched")
            ax.plot(
                n,
                [x["serialized_tok_s"] for x in res["sweep"]],
                "s--",
                label="tokenfleet serialized",
            )
            ax.plot(
                n,
                [x["hf_generate_tok_s"] for x in res["sweep"]],
                "^-",
                label="transformers generate (batch N)",
            )
            ax.plot(
                n,
                [x["forward_only_s"] and x["tokens"] / x["forward_only_s"] for x in res["sweep"]],
                ":",
                color="gray",
                label="tokenfleet forward-only bound",
            )
            ax.set_xscale("log", base=2)
            ax.set_xticks(n, [str(v) for v in n])
            ax.set_xlabel("concurrent sessions")
            ax.set_ylabel("tokens/s")
            ax.set_title(f"{name}: concurrency sweep")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)

            ax = axes[1][col]
            systems = res["mixed"]["systems"]
            labels = [
                "tokenfleet",
                "hf per-request\ngenerate",
                "hf static\nbatch",
                "hf continuous\nbatching",
            ]
            values = [systems[k]["tok_s"] for k in systems]
            bars = ax.bar(labels, values, color=["C0", "C7", "C1", "C2"])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
            ax.set_ylabel("useful tokens/s")
            ax.set_title(f"{name}: mixed workload ({res['mixed']['requests']} requests)")
            ax.tick_params(axis="x", labelsize=8)
