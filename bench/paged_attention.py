"""The CPU paged decode-attention kernel alone (`tokenfleet::decode_attention`,
tokenfleet/model/attention/paged_cpu.cpp) at SmolLM2-135M's shape: 9 query heads, 3 KV
heads, head size 64, 30 layers, blocks of 16 rows placed at random in the pool (as a
busy worker's pool holds them), in bf16 (a bf16 model's pool) and, with `--dtypes
bfloat16,float32`, float32 (the pool of a float32 model: what `--dtype auto` serves on a
CPU without bf16, an AVX2 EPYC say); `float32-f16kv`: a float32 query over a float16
pool (what a float32 model's default start keeps since 2026-12-07: `--kv-dtype`).

Usage: python bench/paged_attention.py [--batches 1,8] [--contexts 128,512]
           [--dtypes bfloat16] [--threads 2] [--rounds 5] [--calls 20] [--resident]
           [--out bench/out/paged_attention.json] [--plot bench/out/paged_attention.png]

For each (dtype, rows B, keys L): one "tick" is 30 calls, one per layer, each row with L keys
in the pool plus its own new key; a round times `--calls` ticks after as many untimed
ones. Rounds go over every shape in turn (interleaved), and each shape's ms per tick is
reported as min / median / max over the rounds. The bytes each tick reads (the rows'
K and V) over the median time give the rate the kernel reads them at.

To compare two versions of the kernel, run this once with each source in place (the
build is cached per source, so switching back costs nothing).

`--resident` adds, for each shape, the same tick with every call reading layer 0: one
layer's rows (about 1 MB at 8 x 160) stay in the core's L2 between calls, where a real
tick's 30 layers (and the weights streamed between them) are read from L3 or memory.
The two medians side by side say how much of the kernel's time is reading the pool
and how much is its own arithmetic.
"""

from __future__ import annotations

import time
from pathlib import Path

from report import figure, machine_info, mark_end, outputs, parser, spread, write_json

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="128,512")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--resident", action="store_true", help="also every call on layer 0")
    outputs(p, "paged_attention")
    args = p.parse_args()
    machine = machine_info()

    import torch

    from tokenfleet.model.attention import paged_cpu

    if not paged_cpu.load():
        raise SystemExit(f"the kernel did not build: {paged_cpu.failure()}")
    torch.set_num_threads(args.threads)
    op = torch.ops.tokenfleet.decode_attention
    gen = torch.Generator().manual_seed(0)

    shapes = []
    for dtype in args.dtypes.split(","):
        kind = getattr(torch, dtype.removesuffix("-f16kv"))
        pool_kind = torch.float16 if dtype.endswith("-f16kv") else kind
        for rows in (int(b) for b in args.batches.split(",")):
            for keys in (int(c) for c in args.contexts.split(",")):
                blocks = -(-(keys + 1) // BLOCK)
                slots = rows * blocks * BLOCK

                def pool(slots: int = slots, kind: torch.dtype = pool_kind) -> torch.Tensor:
                    size = (LAYERS, slots, KV_HEADS, HEAD_DIM)
                    return torch.randn(size, generator=gen).to(kind)

                args_ = (
                    torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(kind),
                    pool(),
                    pool(),
                    torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen).to(kind),
                    torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen).to(kind),
                    torch.randperm(rows * blocks, generator=gen).int().view(rows, blocks),
                    torch.full((rows,), keys, dtype=torch.long),
                )
                shapes.append((dtype, rows, keys, args_, False))
                if args.resident:
                    shapes.append((dtype, rows, keys, args_, True))

    def tick(a: tuple[torch.Tensor, ...], resident: bool) -> None:
        for layer in range(LAYERS):
            op(*a, 0 if resident else layer, BLOCK, 0)

    Key = tuple[str, int, int, bool]
    times: dict[Key, list[float]] = {(d, b, k, r): [] for d, b, k, _, r in shapes}
    for _ in range(args.rounds):
        for dtype, rows, keys, a, resident in shapes:
            for _ in range(args.calls):
                tick(a, resident)
            start = time.perf_counter()
            for _ in range(args.calls):
                tick(a, resident)
            elapsed = time.perf_counter() - start
            times[(dtype, rows, keys, resident)].append(elapsed / args.calls * 1e3)

    results = []
    for dtype, rows, keys, a, resident in shapes:
        s = spread(times[(dtype, rows, keys, resident)])
        size = a[1].element_size()
        read = rows * (keys + 1) * LAYERS * KV_HEADS * HEAD_DIM * size * 2  # K and V
        gbs = read / (s["median"] / 1e3) / 1e9
        results.append({"dtype": dtype, "rows": rows, "keys": keys, "ms_per_tick": s})
        results[-1].update(read_mb=read / 1e6, gb_per_s=round(gbs, 2), resident=resident)
        where = " (layer 0 only: in L2)" if resident else ""
        print(
            f"{dtype:8s} rows {rows:2d} keys {keys:4d}{where}: {s['min']:.3f} / "
            f"{s['median']:.3f} / {s['max']:.3f} ms per tick of {LAYERS} layers "
            f"({read / 1e6:.1f} MB, {gbs:.1f} GB/s)",
            flush=True,
        )
    out = {"threads": args.threads, "rounds": args.rounds, "calls": args.calls}
    out.update(results=results, machine=mark_end(machine))
    write_json(Path(args.out), out)
    with figure(Path(args.plot), 1, 1, figsize=(6, 3.5)) as ax:
        labels = [
            f"{r['dtype'][:4]} {r['rows']}x{r['keys']}{' L2' if r['resident'] else ''}"
            for r in results
        ]
        ax.bar(labels, [r["ms_per_tick"]["median"] for r in results])
        ax.set_ylabel("ms per tick (30 layers), median")
        ax.set_xlabel("rows x keys")
        ax.set_title("tokenfleet::decode_attention, SmolLM2's shape")


if __name__ == "__main__":
    main()
