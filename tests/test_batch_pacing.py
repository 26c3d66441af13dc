"""The submit-pacing rule both batch runners follow (tokenfleet.batch.pacing), driven by
hand: each round's needs are answered from plain data, no Redis and no fleet."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenfleet.batch.format import BatchLine, parse_input
from tokenfleet.batch.pacing import (
    Invalid,
    Need,
    Pacing,
    Room,
    Send,
    Sent,
    carry_out,
    submit_round,
)


def lines(*models: str | None) -> list[BatchLine]:
    """One chat line per entry, for that model (None: a line whose body is invalid)."""
    rows = []
    for i, model in enumerate(models):
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        if model is None:
            body = {"messages": "not a list"}
        row = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions"}
        rows.append(json.dumps({**row, "body": body}))
    return parse_input("\n".join(rows).encode(), "/v1/chat/completions")


class Fleet:
    """Answers a round's needs: each model's (cap, depth), and what each submit does."""

    def __init__(
        self, bands: dict[str, tuple[int, int]], submit: Callable[[BatchLine], Sent] | None = None
    ) -> None:
        self.bands = bands
        self.submit = submit or (lambda line: Sent.OUT)
        self.asked: list[Need] = []

    def answer(self, need: Need) -> Any:
        self.asked.append(need)
        if isinstance(need, Room):
            return self.bands[need.model]
        if isinstance(need, Send):
            return self.submit(need.line)
        return None

    def sent(self) -> list[int]:
        return [n.line.index for n in self.asked if isinstance(n, Send)]


def test_a_round_stops_at_max_in_flight() -> None:
    fleet = Fleet({"m": (1000, 0)})
    todo = lines(*["m"] * 10)
    at = carry_out(submit_round(Pacing(max_in_flight=4), todo, 0, in_flight=1), fleet.answer)
    assert fleet.sent() == [0, 1, 2] and at == 3  # 1 out already + 3 = 4
    assert [n for n in fleet.asked if isinstance(n, Room)] == [Room("m")]  # once per round


def test_a_model_waits_while_its_band_is_at_its_share_of_the_cap() -> None:
    # cap 10, share 0.5: room for ceil(5) - depth 3 = 2 more
    fleet = Fleet({"m": (10, 3), "busy": (10, 5)})
    todo = lines("m", "m", "m", "busy")
    at = carry_out(submit_round(Pacing(queue_share=0.5), todo, 0, 0), fleet.answer)
    assert fleet.sent() == [0, 1] and at == 2  # in order: the third waits, and so does all after
    assert Pacing(queue_share=0.3).room(cap=7, depth=0) == 3  # rounded up


def test_a_full_band_or_tenant_ends_the_round_without_failing_the_line() -> None:
    fleet = Fleet({"m": (1000, 0)}, submit=lambda line: Sent.FULL if line.index == 1 else Sent.OUT)
    todo = lines("m", "m", "m")
    assert carry_out(submit_round(Pacing(), todo, 0, 0), fleet.answer) == 1
    assert fleet.sent() == [0, 1]  # line 1 is tried again next round


def test_a_refused_line_is_passed_and_takes_no_room() -> None:
    fleet = Fleet({"m": (2, 0)}, submit=lambda line: Sent.REFUSED if line.index == 0 else Sent.OUT)
    todo = lines("m", "m", "m")  # room: ceil(2 * 0.5) - 0 = 1
    assert carry_out(submit_round(Pacing(), todo, 0, 0), fleet.answer) == 2
    assert fleet.sent() == [0, 1]


def test_invalid_lines_are_handed_out_once_and_done_lines_are_passed() -> None:
    fleet = Fleet({"m": (1000, 0)})
    todo = lines("m", None, "m", "m")
    at = carry_out(submit_round(Pacing(), todo, 0, 0, done={2}), fleet.answer)
    assert at == 4 and fleet.sent() == [0, 3]
    assert [n.line.index for n in fleet.asked if isinstance(n, Invalid)] == [1]


def test_the_next_round_starts_where_this_one_stopped() -> None:
    fleet = Fleet({"m": (1000, 0)})
    todo = lines(*["m"] * 5)
    pacing = Pacing(max_in_flight=2)
    at = carry_out(submit_round(pacing, todo, 0, 0), fleet.answer)
    assert at == 2
    assert carry_out(submit_round(pacing, todo, at, 2), fleet.answer) == 2  # still full
    assert carry_out(submit_round(pacing, todo, at, 0), fleet.answer) == 4
    assert fleet.sent() == [0, 1, 2, 3]
