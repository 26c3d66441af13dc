"""Each Lua script's header states its KEYS and ARGV slot by slot; the script's call in
tokenfleet.lua.calls declares the same paths, and flattens its fields by them. These
tests hold the two together (and docs/protocol.md's copy of submit.lua's), so adding a
slot to one without the other fails here. No Redis: tests/test_lua_scripts.py runs each
call against a real one."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

import tokenfleet.lua as lua
from tokenfleet.lua import calls
from tokenfleet.lua.calls import (
    AcceptCall,
    AcceptEntry,
    Candidate,
    ClaimOrphansCall,
    DeadLetterCall,
    Finish,
    JobTarget,
    LeaseCall,
    ProbeCall,
    PullBand,
    PullCall,
    RedeliverCall,
    RequeueCall,
    Retention,
    ScriptCall,
    SubmitCall,
    Terminal,
    TickCall,
    TickJob,
    TokenWrite,
)
from tokenfleet.lua.layout import LayoutError, Slot, header, header_slots, parse, slots

FOLDER = Path(lua.__file__).parent
PROTOCOL_MD = Path(__file__).parents[1] / "docs" / "protocol.md"
OWNED = ("accept", "tick", "dead_letter", "redeliver", "requeue")  # owned_entry.lua prepended


def script_text(name: str) -> str:
    return (FOLDER / f"{name}.lua").read_text()


def disagreements(call: type[ScriptCall], text: str) -> list[str]:
    """Where a header (or a doc block) and a call's declared slots differ."""
    found = header_slots(text)
    problems = []
    for array in ("KEYS", "ARGV"):
        stated = found[array]
        declared = slots(getattr(call, array))
        for i in range(max(len(stated), len(declared))):
            says = stated[i] if i < len(stated) else None
            wants = declared[i] if i < len(declared) else None
            if says != wants:
                problems.append(f"{array} line {i + 1}: header {says}, {call.__name__} {wants}")
    return problems


# --- every script has its call, and they agree ----------------------------------------


def test_every_script_has_a_call_and_every_call_a_script() -> None:
    files = {p.stem for p in FOLDER.glob("*.lua")} - {"owned_entry"}
    assert files == set(lua.SCRIPTS) == set(calls.CALLS)


@pytest.mark.parametrize("name", sorted(calls.CALLS))
def test_the_header_states_the_calls_slots(name: str) -> None:
    assert disagreements(calls.CALLS[name], header(script_text(name))) == []


def sample(name: str) -> ScriptCall:
    """A call of each script with every optional part present and two items per list."""
    target = JobTarget(
        result="r", hash="h", events="v", queued="q", running="u", channel="c", job_id="j"
    )
    finish = Finish(reason="stop", result_data=b"R", finish_data=b"F")
    samples: dict[str, ScriptCall] = {
        "submit": SubmitCall(
            stream="s",
            cap="c",
            hash="h",
            models="m",
            queued="q",
            limits="l",
            default_limits="d",
            tenants="t",
            job_id="j",
            payload=b"P",
            default_cap=1000,
            now="1.0",
            model="M",
            tenant="T",
            band="B",
        ),
        "accept": AcceptCall(
            worker="w",
            now="1.0",
            entries=[
                AcceptEntry(**{f.name: f"{f.name}{i}" for f in dataclasses.fields(AcceptEntry)})
                for i in range(2)
            ],
        ),
        "tick": TickCall(
            worker="w",
            now="1.0",
            held=[
                TickJob(
                    stream="s",
                    cancel="c",
                    entry_id="e",
                    job=target,
                    tokens=[TokenWrite(index=i, data=b"T") for i in range(2)],
                    end=finish if ends else None,
                )
                for ends in (False, True)
            ],
        ),
        "dead_letter": DeadLetterCall(
            stream="s",
            dead_letters="d",
            worker="w",
            entry_id="e",
            now="1.0",
            job_id="j",
            reason="r",
            message="m",
            deliveries=3,
            payload=b"",
            terminal=Terminal(job=target, finish=finish),
        ),
        "redeliver": RedeliverCall(stream="s", worker="w", entry_id="e", now="1.0"),
        "requeue": RequeueCall(
            stream="s",
            hash="h",
            queued="q",
            running="r",
            worker="w",
            entry_id="e",
            now="1",
            job_id="j",
        ),
        "pull": PullCall(
            worker="w",
            bands=[PullBand(stream=f"s{i}", name=f"b{i}", floor=i == 1) for i in range(2)],
            pulls="p",
            count=4,
            guard=16,
        ),
        "claim_orphans": ClaimOrphansCall(
            stream="s",
            worker="w",
            candidates=[Candidate(hash=f"h{i}", name=f"n{i}") for i in range(2)],
            min_idle_ms=1000,
            most=5,
        ),
        "probe": ProbeCall(stream="s", hash="h", string="t", zset="z", worker="w", channel="c"),
        "lease": LeaseCall(lease="l", owner="o", ms=15_000, action="take"),
    }
    return samples[name]


@pytest.mark.parametrize("name", sorted(calls.CALLS))
def test_every_field_has_a_slot_and_every_slot_a_wire_value(name: str) -> None:
    call = sample(name)
    used = {parse(path)[0][0] for path in call.KEYS + call.ARGV}
    fields = {f.name for f in dataclasses.fields(call)}
    assert fields <= used  # and what is not a field is derived from them:
    assert all(isinstance(getattr(type(call), name), property) for name in used - fields)
    keys, args = call.keys(), call.args()  # every path resolves, every value is sendable
    assert all(isinstance(k, str) for k in keys)
    assert all(isinstance(a, str | bytes | int | float) and not isinstance(a, bool) for a in args)


def _position(text: str, n: int, i: int) -> int:
    """A header position (`7i-6`, `n+i+5`) with the script's n and item index i put in."""
    total = 0
    for sign, coef, var in re.findall(r"([+-]?)(\d*)([ni]?)", text):
        if coef or var:
            value = int(coef or 1) * {"n": n, "i": i, "": 1}[var]
            total += -value if sign == "-" else value
    return total


@pytest.mark.parametrize("name", sorted(calls.CALLS))
def test_each_stated_position_holds_the_value_of_its_path(name: str) -> None:
    """Positions in 1..n terms (not those counted from a varying item's first slot, a):
    the call's wire holds there the value its path names in the sample, item i's."""
    call = sample(name)
    wire = {"KEYS": call.keys(), "ARGV": call.args()}
    for array in ("KEYS", "ARGV"):
        for slot in header_slots(header(script_text(name)))[array]:
            if ".." in slot.position or re.search(r"[ake]", slot.position):
                continue
            assert re.fullmatch(r"[0-9ni+-]+", slot.position), slot
            for i in range(1, 3) if "[]" in slot.path else [1]:
                value: Any = call
                for step, mark in parse(slot.path):
                    value = getattr(value, step)
                    value = value[i - 1] if mark == "[]" else value
                value = ("1" if value else "0") if isinstance(value, bool) else value
                assert wire[array][_position(slot.position, 2, i) - 1] == value, (slot, i)


def test_the_owned_entry_scripts_keep_its_calling_convention() -> None:
    convention = header_slots(header(script_text("owned_entry")))
    assert [s.path for s in convention["ARGV"]] == ["group", "worker", "entry_id", "now"]
    assert [s.path for s in convention["KEYS"]] == ["stream"]
    for name in OWNED:
        call = calls.CALLS[name]
        assert call.ARGV[:4] in (
            ("group", "worker", "entry_id", "now"),
            ("group", "worker", "no_entry", "now"),  # the entry ids are per item
        )
        assert call.KEYS[0].endswith("stream")


def _table_fields(text: str) -> set[str]:
    """The fields a script hands terminal_writes: `name = ...` in its table constructor."""
    match = re.search(r"terminal_writes\(\{(.*?)\}\)", text, re.S)
    assert match, "no terminal_writes({...}) call"
    return set(re.findall(r"(\w+)\s*=", match[1]))


def test_tick_and_dead_letter_hand_the_terminal_writes_one_shape() -> None:
    shape = {f.name for part in (JobTarget, Finish, Retention) for f in dataclasses.fields(part)}
    writes = script_text("owned_entry")
    body = writes[writes.index("local function terminal_writes(t)") :].split("\nend\n")[0]
    # besides the three parts, one flag no Python call carries: tick.lua appended and
    # published the finish event itself, with the job's last tokens (one entry)
    flags = {"announced"}
    assert set(re.findall(r"\bt\.(\w+)", body)) == shape | flags
    assert _table_fields(script_text("tick")) == shape | flags
    assert _table_fields(script_text("dead_letter")) == shape
    assert "local function terminal(" not in writes  # no second, positional way in


def test_the_protocol_docs_copy_of_the_submit_slots_agrees() -> None:
    text = PROTOCOL_MD.read_text()
    section = text[text.index("## Submitting a job") :]
    block = section[section.index("```") + 3 :]
    block = block[: block.index("```")]
    assert disagreements(SubmitCall, block) == []


# --- the check itself fails where it must ---------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Cancel(ScriptCall):
    SCRIPT = "cancel"
    KEYS = ("flag",)
    ARGV = ("job_id", "ttl")

    flag: str
    job_id: str
    ttl: int


_CANCEL_HEADER = """\
-- Set a job's cancel flag.
--
-- KEYS[1]  flag    the cancel flag
-- ARGV[1]  job_id  the job
-- ARGV[2]  ttl     seconds
"""


def test_a_synthetic_header_and_its_call_agree() -> None:
    assert disagreements(_Cancel, header(_CANCEL_HEADER + "redis.call('SET', KEYS[1], 1)\n")) == []


def test_an_argv_added_to_a_header_without_its_call_fails() -> None:
    grown = _CANCEL_HEADER + "-- ARGV[3]  reason  why\n"
    assert disagreements(_Cancel, header(grown)) == [
        "ARGV line 3: header Slot(position='3', path='reason'), _Cancel None"
    ]


def test_an_argv_added_to_a_call_without_its_header_fails() -> None:
    class Grown(_Cancel):
        ARGV: ClassVar[tuple[str, ...]] = ("job_id", "ttl", "reason")

    assert disagreements(Grown, header(_CANCEL_HEADER)) == [
        "ARGV line 3: header None, Grown Slot(position='3', path='reason')"
    ]


def test_slots_swapped_or_misnumbered_in_a_header_fail() -> None:
    swapped = _CANCEL_HEADER.replace("ARGV[1]  job_id", "ARGV[1]  ttl").replace(
        "ARGV[2]  ttl ", "ARGV[2]  job_id "
    )
    assert len(disagreements(_Cancel, header(swapped))) == 2
    misnumbered = _CANCEL_HEADER.replace("ARGV[2]", "ARGV[3]")
    assert len(disagreements(_Cancel, header(misnumbered))) == 1


# --- the notation --------------------------------------------------------------------


def test_runs_of_varying_width_count_from_their_items_first_slot() -> None:
    assert slots(("n", "jobs[].id", "jobs[].words[]", "jobs[].end?.why")) == [
        Slot("1", "n"),
        Slot("2..", "jobs[]"),
        Slot("a", "jobs[].id"),
        Slot("a+1..a+k", "jobs[].words[]"),
        Slot("a+k+1..a+k+1", "jobs[].end?"),
        Slot("a+k+1", "jobs[].end?.why"),
    ]


def test_a_slot_after_a_run_of_varying_width_cannot_be_stated() -> None:
    with pytest.raises(LayoutError):
        slots(("jobs[].words[]", "after"))
    with pytest.raises(LayoutError):
        slots(("last?.x", "after"))


@dataclass(frozen=True, kw_only=True)
class _Pairs(ScriptCall):
    SCRIPT = "pairs"
    KEYS = ("names[]",)
    ARGV = ("values[]",)

    names: list[str]
    values: list[str]


def test_a_calls_lists_must_have_one_length() -> None:
    assert _Pairs(names=["a"], values=["1"]).args() == ["1"]
    with pytest.raises(ValueError, match="one length"):
        _Pairs(names=["a"], values=[])
