"""The int4 and int8 weight kernels alone (`tokenfleet::q4_linear`, `tokenfleet::int8_linear`,
tokenfleet/model/attention/paged_cpu.cpp) streaming a whole model's weights: SmolLM2-135M's
30 layers (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536) in int4 (66 MB
with the scales), and the same layers in int8 behind its 49,152 x 576 LM head (28 MB more),
so a tick's weights come from memory as in the worker (the L3 here is 32 MB at most).

Usage: python bench/int_kernels.py [--rows 1,4,8] [--kinds int4,int8] [--threads 2]
           [--rounds 9] [--out bench/out/int_kernels.json] [--plot bench/out/int_kernels.png]

A "tick" is one call per weight matrix with `--rows` activation rows (random, bf16);
each round times one tick after an untimed one, and the rounds go over every (kind, rows)
in turn (interleaved). Reported: ms per tick as min / median / max over the rounds, and
the weight bytes over the median time. The weights are random bytes of the packed layouts
(the kernels' speed does not depend on the values).

To compare two versions of the kernels, run this from a checkout of each in turn
(`PYTHONPATH=<checkout>`), alternating, several times: the host's memory bandwidth moves
with its neighbours, so only interleaved runs compare.
"""

from __future__ import annotations

import time
from pathlib import Path

from report import figure, machine_info, mark_end, outputs, parser, spread, write_json

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
HEAD = (49152, 576)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--kinds", default="int4,int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    outputs(p, "int_kernels")
    args = p.parse_args()
    machine = machine_info()

    import torch

    from tokenfleet.model.attention import paged_cpu

    if not paged_cpu.load():
        raise SystemExit(f"the kernels did not build: {paged_cpu.failure()}")
    if not torch.ops.tokenfleet.int_kernels():
        raise SystemExit("this CPU has neither AVX512-VNNI nor AVX2: no int kernels")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    def int4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = -(-n // 16)
        w = torch.randint(0, 256, (g * 16, k // 2), dtype=torch.uint8, generator=gen)
        dm = (torch.randn(2, g, k // 32, 16, generator=gen) * 0.01).half()
        return w, dm, n

    def int8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        r = -(-n // 16) * 16
        w = torch.randint(-127, 128, (r, k), dtype=torch.int8, generator=gen)
        return w, torch.rand(r, generator=gen) * 0.01, n

    layer_shapes = SHAPES * LAYERS
    weights = {
        "int4": (torch.ops.tokenfleet.q4_linear, [int4(n, k) for n, k in layer_shapes]),
        "int8": (torch.ops.tokenfleet.int8_linear, [int8(n, k) for n, k in [HEAD, *layer_shapes]]),
    }
    kinds = args.kinds.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    xs = {(m, k): torch.randn(m, k, generator=gen).bfloat16() for m in rows for k in (576, 1536)}

    def tick(kind: str, m: int) -> None:
        op, mats = weights[kind]
        for w, s, n in mats:
            op(xs[(m, w.size(1) * (2 if kind == "int4" else 1))], w, s, n)

    times: dict[tuple[str, int], list[float]] = {(k, m): [] for k in kinds for m in rows}
    for _ in range(args.rounds):
        for kind in kinds:
            for m in rows:
                tick(kind, m)
                start = time.perf_counter()
                tick(kind, m)
                times[(kind, m)].append((time.perf_counter() - start) * 1e3)

    results = []
    for kind in kinds:
        size = sum(
            w.numel() * w.element_size() + s.numel() * s.element_size()
            for w, s, _ in weights[kind][1]
        )
        for m in rows:
            s = spread(times[(kind, m)])
            gbs = size / (s["median"] / 1e3) / 1e9
            results.append(
                {
                    "kind": kind,
                    "rows": m,
                    "ms_per_tick": s,
                    "weight_mb": size / 1e6,
                    "gb_per_s": round(gbs, 2),
                }
            )
            print(
                f"{kind} rows {m}: {s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f} ms per tick "
                f"({size / 1e6:.1f} MB of weights, {gbs:.1f} GB/s)",
                flush=True,
            )
    out = {
        "threads": args.threads,
        "rounds": args.rounds,
        "kernels": torch.ops.tokenfleet.int_kernels(),
    }
    out.update(results=results, machine=mark_end(machine))
    write_json(Path(args.out), out)
    with figure(Path(args.plot), 1, 1, figsize=(6, 3.5)) as ax:
        ax.bar(
            [f"{r['kind']} x{r['rows']}" for r in results],
            [r["ms_per_tick"]["median"] for r in results],
        )
        ax.set_ylabel("ms per tick (every weight once), median")
        ax.set_title("tokenfleet int4 / int8 kernels, SmolLM2's weights")


if __name__ == "__main__":
    main()
