"""The wire protocol: round trips within every limit, and one error type for every bad shape.

Property tests build messages that respect the documented limits (boundary values
included) and check `decode(encode(m)) == m`; table tests feed one malformed
field at a time and check the `ProtocolError` reason, the field named in the
message and whether the job id is carried back.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from tokenfleet.errors import ProtocolError
from tokenfleet.protocol import (
    JOB_ID_PATTERN,
    MAX_METADATA_ITEMS,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_VALUE_CHARS,
    MAX_NEW_TOKENS,
    MAX_PAYLOAD_BYTES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MODEL_NAME_PATTERN,
    SCHEMA_VERSION,
    DecodeReason,
    ErrorInfo,
    FinishEvent,
    GenerationRequest,
    JobResult,
    SamplingParams,
    Timings,
    TokenEvent,
    Usage,
    decode_event,
    decode_request,
    decode_result,
    encode,
    new_job_id,
)
from tokenfleet.reasons import AdmissionReason, FinishReason

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

INT64 = (-(2**63), 2**63 - 1)  # what msgpack carries for a signed int field
# One character per UTF-8 width (1, 2, 3, 4 bytes), plus combining and control characters.
WIDE_CHARS = ["a", "é", "ß", "中", "語", "😀", "🚀", "\u0301", "\x00", "\n", " "]


def pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def refused(decode: Any, data: Any) -> ProtocolError:
    """Decode `data`, expecting a ProtocolError (and nothing else); return it."""
    with pytest.raises(ProtocolError) as info:
        decode(data)
    err = info.value
    assert isinstance(err.reason, DecodeReason)
    return err


# --- strategies ---------------------------------------------------------------


def text_upto(limit: int, *, min_size: int = 0, small: int = 24) -> st.SearchStrategy[str]:
    """Short unicode text (emoji, CJK, controls...), or exactly `limit` characters."""
    at_limit = st.sampled_from(WIDE_CHARS).map(lambda c: c * limit)
    mixed = st.text(st.sampled_from(WIDE_CHARS), min_size=max(min_size, 1), max_size=small)
    return st.one_of(st.text(min_size=min_size, max_size=min(small, limit)), mixed, at_limit)


job_ids = st.one_of(
    st.from_regex(JOB_ID_PATTERN, fullmatch=True),
    st.sampled_from(["a", "A" * 128, "job-1.x_y", new_job_id()]),
)
model_names = st.one_of(
    st.from_regex(MODEL_NAME_PATTERN, fullmatch=True), st.sampled_from(["m", "m" * 64])
)
token_ids = st.integers(0, MAX_TOKEN_ID)
finite = st.floats(allow_nan=False, allow_infinity=False)
non_negative = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)

sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.0, 10.0),
    top_k=st.integers(0, 1_000_000),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.none() | st.integers(0, MAX_SEED),
)
meta_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(*INT64),
    finite,
    text_upto(MAX_METADATA_VALUE_CHARS),
)
metadata = st.dictionaries(
    text_upto(MAX_METADATA_KEY_CHARS), meta_values, max_size=MAX_METADATA_ITEMS
) | st.builds(  # exactly MAX_METADATA_ITEMS items
    lambda v: {f"k{i}": v for i in range(MAX_METADATA_ITEMS)}, meta_values
)
prompt_id_lists = st.one_of(
    st.lists(token_ids, min_size=1, max_size=32),
    st.builds(lambda t: [t] * MAX_PROMPT_TOKENS, token_ids),
)
common_request_fields: dict[str, st.SearchStrategy[Any]] = {
    "job_id": job_ids,
    "max_new_tokens": st.integers(1, MAX_NEW_TOKENS),
    "sampling": sampling_params,
    "stop": st.lists(text_upto(MAX_STOP_STRING_CHARS, min_size=1), max_size=MAX_STOP_STRINGS),
    "stop_token_ids": st.lists(token_ids, max_size=MAX_STOP_TOKEN_IDS),
    "deadline": st.none() | non_negative,
    "model": st.none() | model_names,
    "metadata": metadata,
}
requests = st.one_of(
    st.builds(
        GenerationRequest, prompt=text_upto(MAX_PROMPT_CHARS, min_size=1), **common_request_fields
    ),
    st.builds(GenerationRequest, prompt_ids=prompt_id_lists, **common_request_fields),
)

usages = st.builds(
    Usage, prompt_tokens=st.integers(0, INT64[1]), completion_tokens=st.integers(0, INT64[1])
)
timings = st.builds(
    Timings, queued_s=st.none() | finite, ttft_s=st.none() | finite, total_s=st.none() | finite
)
error_infos = st.builds(ErrorInfo, reason=text_upto(64), message=text_upto(4096))
token_events = st.builds(
    TokenEvent, job_id=job_ids, index=st.integers(0, INT64[1]), token_id=token_ids, text=st.text()
)
finish_events = st.builds(
    FinishEvent,
    job_id=job_ids,
    reason=st.sampled_from(FinishReason),
    usage=usages,
    timings=timings,
    error=st.none() | error_infos,
    worker=st.none() | st.text(),
)
job_results = st.builds(
    JobResult,
    job_id=job_ids,
    text=st.text(),
    token_ids=st.lists(st.integers(0, MAX_TOKEN_ID), max_size=64),
    finish_reason=st.sampled_from(FinishReason),
    usage=usages,
    timings=timings,
    error=st.none() | error_infos,
    worker=st.none() | st.text(),
)


# --- round trips ----------------------------------------------------------------


def assert_round_trip(data: bytes, decode: Any, message: BaseModel) -> None:
    """Within the payload limit the message comes back equal; over it, OVERSIZE and only that."""
    if len(data) <= MAX_PAYLOAD_BYTES:
        back = decode(data)
        assert type(back) is type(message)
        assert back == message
    else:
        assert refused(decode, data).reason == DecodeReason.OVERSIZE


@FAST
@given(requests)
def test_request_round_trip(request: GenerationRequest) -> None:
    assert_round_trip(encode(request), decode_request, request)


@FAST
@given(requests, st.booleans())
def test_request_round_trip_as_json_object(request: GenerationRequest, ascii_only: bool) -> None:
    text = json.dumps(request.model_dump(mode="json"), ensure_ascii=ascii_only)
    assert text.startswith("{")
    assert_round_trip(text.encode(), decode_request, request)


@FAST
@given(token_events | finish_events)
def test_event_round_trip(event: TokenEvent | FinishEvent) -> None:
    assert_round_trip(encode(event), decode_event, event)


@FAST
@given(job_results)
def test_result_round_trip(result: JobResult) -> None:
    assert_round_trip(encode(result), decode_result, result)


@pytest.mark.parametrize(
    "message",
    [
        GenerationRequest(prompt="hi"),
        TokenEvent(job_id="j", index=0, token_id=1),
        FinishEvent(job_id="j", reason=FinishReason.LENGTH),
        JobResult(job_id="j", finish_reason=FinishReason.STOP),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_message_is_a_msgpack_map_with_integer_version(message: BaseModel) -> None:
    obj = msgpack.unpackb(encode(message), raw=False)
    assert isinstance(obj, dict)
    assert type(obj["v"]) is int and obj["v"] == SCHEMA_VERSION == 1


def test_enums_go_on_the_wire_as_plain_strings() -> None:
    event = FinishEvent(
        job_id="j", reason=FinishReason.CANCELLED, error=ErrorInfo(reason="x", message="y")
    )
    obj = msgpack.unpackb(encode(event), raw=False)
    assert obj["type"] == "finish"
    assert obj["reason"] == "cancelled" and type(obj["reason"]) is str


def test_decoded_defaults_match_constructed_defaults() -> None:
    back = decode_request(pack({"v": 1, "job_id": "j", "prompt": "hi"}))
    assert back == GenerationRequest(job_id="j", prompt="hi")
    assert back.max_new_tokens == 128 and back.stop == []
    # sampling left to the model's defaults (greedy where it names none)
    assert back.sampling.temperature is None and back.sampling.top_k is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt", "中" * MAX_PROMPT_CHARS),
        ("prompt_ids", [MAX_TOKEN_ID] * MAX_PROMPT_TOKENS),
        ("max_new_tokens", MAX_NEW_TOKENS),
        ("max_new_tokens", 0),  # prefill only
        ("stop", ["😀" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS),
        ("stop_token_ids", [0] * MAX_STOP_TOKEN_IDS),
        ("metadata", {"k" * MAX_METADATA_KEY_CHARS: "😀" * MAX_METADATA_VALUE_CHARS}),
        ("metadata", {f"k{i}": None for i in range(MAX_METADATA_ITEMS)}),
        ("sampling", {"temperature": 10.0, "top_k": 1_000_000, "top_p": 1.0, "seed": MAX_SEED}),
        ("sampling", {"temperature": 0.0, "top_k": 0, "top_p": 5e-324, "seed": 0}),
        ("job_id", "J" * 128),
        ("model", "m" * 64),
        ("deadline", 0.0),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 20 else "",
)
def test_values_exactly_at_a_limit_are_accepted(field: str, value: Any) -> None:
    obj: dict[str, Any] = {"v": 1, "job_id": "j", "prompt": "hi", field: value}
    if field == "prompt_ids":
        del obj["prompt"]
    back = decode_request(pack(obj))
    got = back.sampling.model_dump() if field == "sampling" else getattr(back, field)
    assert got == value


def test_a_request_within_every_field_limit_fits_the_payload_limit() -> None:
    request = GenerationRequest(
        job_id="j" * 128,
        prompt="😀" * MAX_PROMPT_CHARS,
        stop=["😀" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        metadata={
            f"{i:0{MAX_METADATA_KEY_CHARS}d}": "😀" * MAX_METADATA_VALUE_CHARS
            for i in range(MAX_METADATA_ITEMS)
        },
    )
    data = encode(request)
    assert len(data) <= MAX_PAYLOAD_BYTES
    assert decode_request(data) == request


# --- JSON object payloads -----------------------------------------------------------


def test_json_object_is_accepted_for_requests() -> None:
    text = '{"v": 1, "job_id": "from-shell", "prompt": "héllo 中文 😀", "max_new_tokens": 4}'
    back = decode_request(text.encode())
    assert back == GenerationRequest(job_id="from-shell", prompt="héllo 中文 😀", max_new_tokens=4)


@pytest.mark.parametrize("decode", [decode_event, decode_result], ids=["event", "result"])
def test_json_object_is_refused_for_events_and_results(decode: Any) -> None:
    event = {"v": 1, "type": "finish", "job_id": "j", "reason": "stop", "finish_reason": "stop"}
    assert refused(decode, json.dumps(event).encode()).reason == DecodeReason.NOT_MSGPACK


@pytest.mark.parametrize(
    "text",
    [b"{", b"{'v': 1}", b'{"v": 1, "prompt": "x"} trailing', b'{"v": 1, "prompt": "\xff"}'],
)
def test_broken_json_object_is_not_msgpack(text: bytes) -> None:
    assert refused(decode_request, text).reason == DecodeReason.NOT_MSGPACK


def test_json_non_finite_numbers_are_refused() -> None:
    err = refused(decode_request, b'{"v": 1, "prompt": "x", "deadline": NaN}')
    assert err.reason == DecodeReason.INVALID_FIELD and "deadline" in str(err)


# --- refusals: framing and version ---------------------------------------------------

ALL_DECODERS = pytest.mark.parametrize(
    "decode", [decode_request, decode_event, decode_result], ids=["request", "event", "result"]
)


@ALL_DECODERS
@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x81", b"\x82\xa1v\x01", pack({"v": 1}) + b"\x00", "not bytes", None, 42],
    ids=[
        "empty",
        "reserved-byte",
        "truncated-map",
        "truncated-pair",
        "extra-data",
        "str",
        "none",
        "int",
    ],
)
def test_not_msgpack(decode: Any, data: Any) -> None:
    err = refused(decode, data)
    assert err.reason == DecodeReason.NOT_MSGPACK
    assert err.job_id is None


@ALL_DECODERS
@pytest.mark.parametrize("obj", [[1, 2], [], 5, -1, "str", b"bytes", None, 1.5, True])
def test_not_a_map(decode: Any, obj: Any) -> None:
    err = refused(decode, pack(obj))
    assert err.reason == DecodeReason.NOT_A_MAP
    assert err.job_id is None


@ALL_DECODERS
def test_missing_version_carries_a_readable_job_id(decode: Any) -> None:
    err = refused(decode, pack({"job_id": "job-7", "prompt": "x"}))
    assert err.reason == DecodeReason.MISSING_VERSION
    assert err.job_id == "job-7"
    assert "'v'" in str(err)


@ALL_DECODERS
@pytest.mark.parametrize("version", [2, 0, -1, "1", True, False, None, 1.5, [1], {"v": 1}])
def test_unknown_version(decode: Any, version: Any) -> None:
    err = refused(decode, pack({"v": version, "job_id": "job-7", "prompt": "x"}))
    assert err.reason == DecodeReason.UNKNOWN_VERSION
    assert err.job_id == "job-7"


def test_float_version_is_unknown() -> None:
    try:
        back = decode_request(pack({"v": 1.0, "job_id": "j", "prompt": "x"}))
    except ProtocolError as err:
        assert err.reason == DecodeReason.UNKNOWN_VERSION
    else:
        raise AssertionError(f"v=1.0 was accepted as {back!r}")


def test_oversize_is_checked_before_parsing() -> None:
    err = refused(decode_request, b"\x00" * (MAX_PAYLOAD_BYTES + 1))
    assert err.reason == DecodeReason.OVERSIZE
    big_text_event = pack(
        {
            "v": 1,
            "type": "token",
            "job_id": "j",
            "index": 0,
            "token_id": 0,
            "text": "x" * MAX_PAYLOAD_BYTES,
        }
    )
    assert refused(decode_event, big_text_event).reason == DecodeReason.OVERSIZE


# --- refusals: one bad field at a time ------------------------------------------------

BASE: dict[str, Any] = {"v": 1, "job_id": "job-1", "prompt": "hello"}
DROP = object()  # marks a field to remove from BASE

INVALID_REQUEST_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    # (case id, changes to BASE, text the message must contain)
    ("max_new_tokens-str", {"max_new_tokens": "5"}, "max_new_tokens"),
    ("max_new_tokens-float", {"max_new_tokens": 5.0}, "max_new_tokens"),
    ("max_new_tokens-bool", {"max_new_tokens": True}, "max_new_tokens"),
    ("max_new_tokens-negative", {"max_new_tokens": -1}, "max_new_tokens"),
    ("max_new_tokens-neg", {"max_new_tokens": -5}, "max_new_tokens"),
    ("max_new_tokens-over", {"max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens"),
    ("max_new_tokens-huge", {"max_new_tokens": 2**64 - 1}, "max_new_tokens"),
    ("prompt-int", {"prompt": 123}, "prompt"),
    ("prompt-bytes", {"prompt": b"hello"}, "prompt"),
    ("prompt-empty", {"prompt": ""}, "prompt"),
    ("prompt-over", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
    ("prompt-none", {"prompt": None}, "prompt"),
    ("prompt_ids-str", {"prompt": DROP, "prompt_ids": [1, "2"]}, "prompt_ids"),
    ("prompt_ids-neg", {"prompt": DROP, "prompt_ids": [1, -1]}, "prompt_ids"),
    ("prompt_ids-float", {"prompt": DROP, "prompt_ids": [1, 2.0]}, "prompt_ids"),
    ("prompt_ids-big", {"prompt": DROP, "prompt_ids": [MAX_TOKEN_ID + 1]}, "prompt_ids"),
    ("prompt_ids-empty", {"prompt": DROP, "prompt_ids": []}, "prompt_ids"),
    (
        "prompt_ids-over",
        {"prompt": DROP, "prompt_ids": [1] * (MAX_PROMPT_TOKENS + 1)},
        "prompt_ids",
    ),
    ("prompt_ids-map", {"prompt": DROP, "prompt_ids": {"0": 1}}, "prompt_ids"),
    ("both-prompts", {"prompt_ids": [1, 2]}, "prompt"),
    ("no-prompt", {"prompt": DROP}, "prompt"),
    ("sampling-list", {"sampling": [0.5]}, "sampling"),
    ("sampling-extra", {"sampling": {"beams": 2}}, "beams"),
    ("temperature-str", {"sampling": {"temperature": "0.5"}}, "temperature"),
    ("temperature-neg", {"sampling": {"temperature": -1.0}}, "temperature"),
    ("temperature-nan", {"sampling": {"temperature": math.nan}}, "temperature"),
    ("temperature-inf", {"sampling": {"temperature": math.inf}}, "temperature"),
    ("temperature-over", {"sampling": {"temperature": 10.5}}, "temperature"),
    ("top_p-0", {"sampling": {"top_p": 0.0}}, "top_p"),
    ("top_p-over", {"sampling": {"top_p": 1.5}}, "top_p"),
    ("top_k-neg", {"sampling": {"top_k": -1}}, "top_k"),
    ("top_k-float", {"sampling": {"top_k": 5.0}}, "top_k"),
    ("seed-neg", {"sampling": {"seed": -1}}, "seed"),
    ("seed-over", {"sampling": {"seed": MAX_SEED + 1}}, "seed"),
    ("extra-field", {"priority": 1}, "priority"),
    ("stop-str", {"stop": "END"}, "stop"),
    ("stop-too-many", {"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ("stop-too-long", {"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ("stop-empty-string", {"stop": [""]}, "stop"),
    ("stop-int", {"stop": [1]}, "stop"),
    ("stop_token_ids-over", {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ("stop_token_ids-neg", {"stop_token_ids": [-1]}, "stop_token_ids"),
    (
        "metadata-too-many",
        {"metadata": {f"k{i}": 1 for i in range(MAX_METADATA_ITEMS + 1)}},
        "metadata",
    ),
    ("metadata-value-long", {"metadata": {"k": "x" * (MAX_METADATA_VALUE_CHARS + 1)}}, "metadata"),
    ("metadata-key-long", {"metadata": {"k" * (MAX_METADATA_KEY_CHARS + 1): 1}}, "metadata"),
    ("metadata-value-list", {"metadata": {"k": [1]}}, "metadata"),
    ("metadata-value-nan", {"metadata": {"k": math.nan}}, "metadata"),
    ("metadata-list", {"metadata": [["k", 1]]}, "metadata"),
    ("deadline-neg", {"deadline": -1.0}, "deadline"),
    ("deadline-str", {"deadline": "soon"}, "deadline"),
    ("deadline-inf", {"deadline": math.inf}, "deadline"),
    ("model-space", {"model": "llama 3"}, "model"),
    ("model-colon", {"model": "a:b"}, "model"),
    ("model-long", {"model": "m" * 65}, "model"),
    ("model-empty", {"model": ""}, "model"),
]


def _with(changes: dict[str, Any]) -> dict[str, Any]:
    obj = {**BASE, **changes}
    return {k: v for k, v in obj.items() if v is not DROP}


@pytest.mark.parametrize(
    ("changes", "named"),
    [pytest.param(changes, named, id=case) for case, changes, named in INVALID_REQUEST_FIELDS],
)
def test_invalid_field_is_refused_naming_it(changes: dict[str, Any], named: str) -> None:
    obj = _with(changes)
    for data in (pack(obj), _as_json(obj)):
        if data is None:
            continue
        err = refused(decode_request, data)
        assert err.reason == DecodeReason.INVALID_FIELD, err
        assert named in str(err)
        assert err.job_id == "job-1"  # readable and valid: the client can be told


def _as_json(obj: dict[str, Any]) -> bytes | None:
    """The same payload as a JSON object, where JSON can say it (no bytes, no NaN/inf)."""
    try:
        return json.dumps(obj, allow_nan=False).encode()
    except (TypeError, ValueError):
        return None


@pytest.mark.parametrize(
    "job_id",
    [" a b", "a b", "", "x" * 129, "x:events", "a/b", "é", 5, None, b"job-1", ["job-1"]],
    ids=repr,
)
def test_bad_job_id_is_refused_and_not_carried(job_id: Any) -> None:
    err = refused(decode_request, pack({**BASE, "job_id": job_id}))
    assert err.reason == DecodeReason.INVALID_FIELD
    assert "job_id" in str(err)
    assert err.job_id is None


def test_job_id_with_trailing_newline_is_not_carried() -> None:
    err = refused(decode_request, pack({**BASE, "job_id": "job-1\n"}))
    assert err.reason == DecodeReason.INVALID_FIELD
    assert err.job_id is None


def test_job_id_is_carried_on_result_errors() -> None:
    err = refused(decode_result, pack({"v": 1, "job_id": "r-1", "finish_reason": "done"}))
    assert (err.reason, err.job_id) == (DecodeReason.INVALID_FIELD, "r-1")
    assert "finish_reason" in str(err)


def test_event_errors_name_the_field() -> None:
    obj = {"v": 1, "type": "token", "job_id": "e-1", "index": -1, "token_id": 0}
    err = refused(decode_event, pack(obj))
    assert err.reason == DecodeReason.INVALID_FIELD
    assert "index" in str(err)


def test_job_id_is_carried_on_event_errors() -> None:
    obj = {"v": 1, "type": "token", "job_id": "e-1", "index": -1, "token_id": 0}
    assert refused(decode_event, pack(obj)).job_id == "e-1"


@pytest.mark.parametrize(
    "obj",
    [
        {"v": 1, "job_id": "e", "index": 0, "token_id": 0},  # no type
        {"v": 1, "type": "bogus", "job_id": "e"},
        {"v": 1, "type": "token", "job_id": "e", "index": 0},  # no token_id
        {"v": 1, "type": "finish", "job_id": "e", "reason": "timeout"},
        {"v": 1, "type": "finish", "job_id": "e", "reason": "stop", "extra": 1},
        {"v": 1, "type": "token", "job_id": "e", "index": 0, "token_id": MAX_TOKEN_ID + 1},
    ],
)
def test_malformed_events_are_invalid_field(obj: dict[str, Any]) -> None:
    assert refused(decode_event, pack(obj)).reason == DecodeReason.INVALID_FIELD


def test_every_accepted_json_request_can_be_re_encoded() -> None:
    request = decode_request(b'{"v": 1, "job_id": "j", "prompt": "x", "metadata": {"n": 1e0}}')
    assert decode_request(encode(request)) == request
    request = decode_request(
        b'{"v": 1, "job_id": "j", "prompt": "x", "metadata": {"n": %d}}' % 2**64
    )
    assert decode_request(encode(request)) == request


def test_constructing_an_invalid_message_raises_validation_error() -> None:
    with pytest.raises(ValidationError):
        GenerationRequest(prompt="x", prompt_ids=[1])
    with pytest.raises(ValidationError):
        GenerationRequest(prompt="x", max_new_tokens=-1)


# --- fuzzing: nothing but ProtocolError ------------------------------------------


def assert_only_protocol_errors(data: bytes) -> None:
    for decode, kinds in (
        (decode_request, (GenerationRequest,)),
        (decode_event, (TokenEvent, FinishEvent)),
        (decode_result, (JobResult,)),
    ):
        try:
            message = decode(data)
        except ProtocolError as err:
            assert err.reason in set(DecodeReason)
            assert err.job_id is None or isinstance(err.job_id, str)
        else:
            assert isinstance(message, kinds)
            # whatever is accepted re-encodes to an equal message
            assert decode(encode(message)) == message


@FUZZ
@given(st.binary(max_size=256) | st.binary(max_size=256).map(lambda b: b"{" + b))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    assert_only_protocol_errors(data)


msgpackable = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)
FIELD_NAMES = [
    *GenerationRequest.model_fields,
    *SamplingParams.model_fields,
    *FinishEvent.model_fields,
    *TokenEvent.model_fields,
    *JobResult.model_fields,
]
# Maps that look like messages: a valid version and job id, known field names, hostile values.
near_messages = st.fixed_dictionaries(
    {"v": st.just(1) | msgpackable, "job_id": st.just("fz-1") | msgpackable},
    optional={
        "prompt": st.just("hi") | msgpackable,
        "type": st.sampled_from(["token", "finish"]) | msgpackable,
        "sampling": st.dictionaries(st.sampled_from(FIELD_NAMES), msgpackable, max_size=4)
        | msgpackable,
    },
).flatmap(
    lambda base: st.dictionaries(st.sampled_from(FIELD_NAMES), msgpackable, max_size=5).map(
        lambda extra: {**extra, **base}
    )
)


@FUZZ
@given(msgpackable | near_messages)
def test_arbitrary_msgpack_objects_only_raise_protocol_error(obj: Any) -> None:
    assert_only_protocol_errors(pack(obj))


@FAST
@given(near_messages)
def test_arbitrary_json_objects_only_raise_protocol_error(obj: Any) -> None:
    data = _as_json(obj)
    if data is not None:
        assert_only_protocol_errors(data)


@FAST
@given(requests, st.integers(0, 2**16), st.integers(0, 255))
def test_corrupted_requests_only_raise_protocol_error(
    request: GenerationRequest, position: int, byte: int
) -> None:
    data = bytearray(encode(request))
    data[position % len(data)] = byte
    assert_only_protocol_errors(bytes(data))
    assert_only_protocol_errors(bytes(data[: position % len(data)]))


# --- reasons ----------------------------------------------------------------------


def test_finish_reasons_are_stable() -> None:
    assert {r.value for r in FinishReason} == {
        "stop",
        "length",
        "cancelled",
        "deadline",
        "rejected",
        "error",
    }


def test_admission_reasons_are_stable() -> None:
    assert {r.value for r in AdmissionReason} == {
        "admitted",
        "queued",
        "rejected_kv_budget",
        "rejected_scratch_budget",
        "rejected_queue_full",
        "rejected_duplicate",
        "rejected_invalid",
    }
    assert {r for r in AdmissionReason if r.accepted} == {
        AdmissionReason.ADMITTED,
        AdmissionReason.QUEUED,
    }


def test_decode_reasons_are_stable() -> None:
    assert {r.value for r in DecodeReason} == {
        "oversize",
        "not_msgpack",
        "not_a_map",
        "missing_version",
        "unknown_version",
        "invalid_field",
    }


@pytest.mark.parametrize("enum", [FinishReason, AdmissionReason, DecodeReason])
def test_reasons_are_lowercase_str_enums(enum: Any) -> None:
    for member in enum:
        assert isinstance(member, str)
        assert member.value == member.value.lower() == str(member) == f"{member}"
        assert member.value.replace("_", "").isalpha()
        assert enum(member.value) is member  # reads back from a Redis string


def test_protocol_error_reason_reads_as_a_plain_string() -> None:
    err = refused(decode_request, pack([]))
    assert err.reason == "not_a_map"
    assert str(err).startswith("not_a_map: ")
    assert msgpack.unpackb(pack(str(err.reason))) == "not_a_map"
