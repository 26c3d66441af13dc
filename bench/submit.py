"""Submit throughput from one Python process: one-at-a-time `submit` vs `submit_many`.

Usage: python bench/submit.py [--redis-url URL] [--jobs N] [--out bench/out/submit.json]
Uses a throw-away key prefix and deletes it afterwards. Prints a table, writes JSON.
"""

from __future__ import annotations

import platform
import uuid
from functools import partial
from pathlib import Path

import redis
from _rounds import timed
from report import outputs, parser, write_json

from tokenfleet.keys import Keys
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest


def run(url: str, jobs: int, batch: int) -> dict[str, object]:
    client = redis.Redis.from_url(url)
    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    producer = Producer(client, keys=Keys(prefix), default_cap=jobs * 3)

    def fresh() -> list[GenerationRequest]:  # new job ids for each mode
        return [
            GenerationRequest(prompt=f"prompt number {i}", max_new_tokens=64) for i in range(jobs)
        ]

    def one_at_a_time(requests: list[GenerationRequest]) -> None:
        for req in requests:
            producer.submit(req)

    def in_batches(requests: list[GenerationRequest]) -> None:
        for i in range(0, jobs, batch):
            assert all(o.accepted for o in producer.submit_many(requests[i : i + batch]))

    single_s, _ = timed(partial(one_at_a_time, fresh()))
    many_s, _ = timed(partial(in_batches, fresh()))

    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)
    info = client.info("server")
    return {
        "jobs": jobs,
        "batch": batch,
        "submit_per_s": jobs / single_s,
        "submit_many_per_s": jobs / many_s,
        "ratio": single_s / many_s,
        "redis_version": info.get("redis_version"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--batch", type=int, default=500)
    outputs(p, "submit", plot=False)
    args = p.parse_args()
    result = run(args.redis_url, args.jobs, args.batch)
    write_json(Path(args.out), result)
    print(f"{'mode':<14}{'jobs/s':>10}")
    print(f"{'submit':<14}{result['submit_per_s']:>10,.0f}")
    print(f"{'submit_many':<14}{result['submit_many_per_s']:>10,.0f}  (batches of {args.batch})")


if __name__ == "__main__":
    main()
