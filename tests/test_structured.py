"""Structured output (issue 14, part 2): grammars enforced while decoding (llguidance).

The tiny random model's free output is noise, so every valid JSON document below is the
grammar's doing: 100 sampled jobs against a schema of enums, booleans, bounded integers
and short strings all validate (jsonschema); a regex job matches its regex; a grammar
that cannot compile is rejected_invalid with the library's message; a length stop
inside the structure says `length`; a resumed job rebuilds the grammar state from its
emitted tokens; and jobs without a grammar in the same batch are untouched.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import jsonschema
import pytest

from tokenfleet.model import LoadedModel, load_model
from tokenfleet.protocol import ErrorInfo, GenerationRequest, SamplingParams, Structured
from tokenfleet.reasons import AdmissionReason, FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig, Finished

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
    },
    "required": ["color", "ok", "count", "name"],
    "additionalProperties": False,
}
AS_SCHEMA = Structured(kind="json_schema", value=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded, EngineConfig(max_active=32, max_batch_size=32, max_waiting=128))


def run(eng: Engine, jobs: list[GenerationRequest]) -> dict[str, Finished]:
    for job in jobs:
        decision = eng.submit(job)
        assert decision.accepted or decision.reason is AdmissionReason.REJECTED_INVALID
    done: dict[str, Finished] = {}
    while eng.has_work:
        for f in eng.step().finished:
            done[f.job_id] = f
    return done


def test_a_hundred_sampled_jobs_all_validate_against_the_schema(tiny: LoadedModel) -> None:
    jobs = [
        GenerationRequest(
            job_id=f"s{i}",
            prompt=f"make record {i}",
            max_new_tokens=200,
            sampling=SamplingParams(temperature=1.0, seed=i),
            structured=AS_SCHEMA,
        )
        for i in range(100)
    ]
    done = run(engine(tiny), jobs)
    assert len(done) == 100
    seen = defaultdict(set)
    for f in done.values():
        assert f.result.finish_reason is FinishReason.STOP, f.result
        record = json.loads(f.result.text)
        jsonschema.validate(record, SCHEMA)
        for key, value in record.items():
            seen[key].add(json.dumps(value))
    # sampled: the grammar constrains the form, the model still chooses the values
    assert len(seen["color"]) > 1 and len(seen["name"]) > 10


def test_json_object_regex_and_lark(tiny: LoadedModel) -> None:
    pattern = r"[a-z]{3}-[0-9]{2,4}"
    jobs = [
        GenerationRequest(
            job_id="obj",
            prompt="x",
            max_new_tokens=120,
            sampling=SamplingParams(temperature=1.0, seed=1),
            structured=Structured(kind="json_object"),
        ),
        GenerationRequest(
            job_id="re",
            prompt="x",
            max_new_tokens=20,
            sampling=SamplingParams(temperature=1.0, seed=2),
            structured=Structured(kind="regex", value=pattern),
        ),
        GenerationRequest(
            job_id="lark",
            prompt="x",
            max_new_tokens=20,
            sampling=SamplingParams(temperature=1.0, seed=3),
            structured=Structured(kind="lark", value='start: "yes" | "no"'),
        ),
    ]
    done = run(engine(tiny), jobs)
    # any JSON object: unbounded, so the noise may run to the length limit; when the
    # grammar completes, the text is an object
    obj = done.pop("obj").result
    if obj.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason is FinishReason.LENGTH and obj.text.startswith("{")
    assert re.fullmatch(pattern, done["re"].result.text), done["re"].result.text
    assert done["lark"].result.text in ("yes", "no")
    assert all(f.result.finish_reason is FinishReason.STOP for f in done.values())


def test_a_grammar_that_cannot_compile_is_rejected_naming_the_problem(tiny: LoadedModel) -> None:
    eng = engine(tiny)
    bad = [
        GenerationRequest(job_id="re", prompt="x", structured=Structured(kind="regex", value="(")),
        GenerationRequest(
            job_id="js", prompt="x", structured=Structured(kind="json_schema", value="{not json")
        ),
    ]
    done = run(eng, bad)
    for job_id, words in (("re", "unclosed group"), ("js", "invalid json_schema")):
        result = done[job_id].result
        assert result.finish_reason is FinishReason.REJECTED
        assert result.error is not None and result.error.reason == "rejected_invalid"
        assert words in result.error.message, result.error.message


def test_a_length_stop_inside_the_structure_says_length(tiny: LoadedModel) -> None:
    job = GenerationRequest(job_id="short", prompt="x", max_new_tokens=6, structured=AS_SCHEMA)
    result = run(engine(tiny), [job])["short"].result
    assert result.finish_reason is FinishReason.LENGTH
    assert result.usage.completion_tokens == 6
    with pytest.raises(ValueError):
        json.loads(result.text)  # cut short: not valid, and not reported as if it were


def test_a_resumed_job_continues_its_grammar_from_the_emitted_tokens(tiny: LoadedModel) -> None:
    job = GenerationRequest(
        job_id="r",
        prompt="resume me",
        max_new_tokens=200,
        sampling=SamplingParams(temperature=1.0, seed=7),
        structured=AS_SCHEMA,
    )
    whole = run(engine(tiny), [job])["r"].result
    eng = engine(tiny)
    cut = len(whole.token_ids) // 2
    assert eng.submit(job, resume_ids=whole.token_ids[:cut]).accepted
    rest: list[int] = []
    while eng.has_work:
        out = eng.step()
        rest += [e.token_id for e in out.tokens]
    assert whole.token_ids[:cut] + rest == whole.token_ids  # seeded: the same continuation
    jsonschema.validate(json.loads(whole.text), SCHEMA)


def test_jobs_without_a_grammar_are_untouched_by_structured_neighbours(tiny: LoadedModel) -> None:
    plain = [
        GenerationRequest(job_id=f"p{i}", prompt=f"plain {i}", max_new_tokens=12, ignore_eos=True)
        for i in range(4)
    ]
    alone = run(engine(tiny), plain)
    structured = [
        GenerationRequest(
            job_id=f"j{i}", prompt=f"json {i}", max_new_tokens=60, structured=AS_SCHEMA
        )
        for i in range(4)
    ]
    mixed = run(engine(tiny), [x for pair in zip(plain, structured, strict=True) for x in pair])
    for job in plain:
        assert mixed[job.job_id].result.token_ids == alone[job.job_id].result.token_ids


# ---- grammars the fleet can never honour, and outputs that end outside the grammar ----

SELF_NESTED = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}


@pytest.mark.parametrize(
    ("kind", "value", "words"),
    [
        # every instance must contain another: the library gives up at its item limit
        ("json_schema", json.dumps(SELF_NESTED), "no output the grammar library can finish"),
        (
            "json_schema",
            json.dumps({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
            "Too many items",
        ),
        # a $ref to itself: no document at all (this ran as `stop` with empty text)
        ("json_schema", json.dumps({"$ref": "#"}), "allows no output at all"),
        ("lark", 'start: "{" start "}"', "no output the grammar library can finish"),
    ],
)
def test_a_grammar_with_no_finite_output_is_refused_before_any_token(
    tiny: LoadedModel, kind: str, value: str, words: str
) -> None:
    job = GenerationRequest(
        job_id="never",
        prompt="x",
        max_new_tokens=50,
        structured=Structured.model_validate({"kind": kind, "value": value}),
    )
    result = run(engine(tiny), [job])["never"].result
    assert result.finish_reason is FinishReason.REJECTED, result
    assert result.error is not None and result.error.reason == "rejected_invalid"
    assert words in result.error.message, result.error.message
    assert result.usage.completion_tokens == 0 and result.text == ""


def _nested_const(depth: int) -> dict[str, object]:
    """A schema nesting exactly `depth` objects and arrays: {"const": [[...]]}."""
    value: list[object] = []
    for _ in range(depth - 2):
        value = [value]
    return {"const": value}


def test_schema_nesting_is_refused_naming_the_limit(tiny: LoadedModel) -> None:
    from llguidance import LLMatcher

    from tokenfleet.grammar import MAX_SCHEMA_DEPTH

    # the library itself reads MAX_SCHEMA_DEPTH levels and not one more (the limit is
    # llguidance's; the check names it before the library's column in its own text)
    for depth, ok in ((MAX_SCHEMA_DEPTH, True), (MAX_SCHEMA_DEPTH + 1, False)):
        text = LLMatcher.grammar_from_json_schema(_nested_const(depth))
        assert (LLMatcher.validate_grammar(text) == "") is ok, depth
    too_deep = json.dumps(_nested_const(MAX_SCHEMA_DEPTH + 1))
    jobs = [
        GenerationRequest(
            job_id="deep", prompt="x", structured=Structured(kind="json_schema", value=too_deep)
        ),
        # thousands of levels: Python's own JSON parser runs out of recursion (this
        # raised RecursionError out of Engine.submit, past the job's refusal)
        GenerationRequest(
            job_id="deeper",
            prompt="x",
            structured=Structured(kind="json_schema", value="[" * 60000),
        ),
        GenerationRequest(
            job_id="fits",
            prompt="x",
            max_new_tokens=300,
            structured=Structured(
                kind="json_schema", value=json.dumps(_nested_const(MAX_SCHEMA_DEPTH))
            ),
        ),
    ]
    done = run(engine(tiny), jobs)
    for job_id in ("deep", "deeper"):
        result = done[job_id].result
        assert result.finish_reason is FinishReason.REJECTED
        assert result.error is not None and result.error.reason == "rejected_invalid"
        assert f"MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}" in result.error.message, result.error
    assert "nests 125 levels deep" in (done["deep"].result.error or ErrorInfo).message
    fits = done["fits"].result
    assert fits.finish_reason is FinishReason.STOP, fits
    assert json.loads(fits.text) == _nested_const(MAX_SCHEMA_DEPTH)["const"]


def test_an_output_cut_inside_the_structure_never_ends_as_stop(tiny: LoadedModel) -> None:
    """A stop string or a stop token id inside the structure ends the job `rejected`,
    `grammar_unsatisfied` (this was `stop`, with text that is not JSON)."""
    jobs = [
        # the schema's output opens with {"color":" — the stop string cuts it at once
        GenerationRequest(job_id="string", prompt="x", stop=["color"], structured=AS_SCHEMA),
        GenerationRequest(
            job_id="token", prompt="x", stop_token_ids=[ord('"')], structured=AS_SCHEMA
        ),
    ]
    done = run(engine(tiny), jobs)
    quote = ord('"')
    for job_id, why in (("string", "a stop string"), ("token", f"stop token {quote}")):
        result = done[job_id].result
        assert result.finish_reason is FinishReason.REJECTED, result
        assert result.error is not None and result.error.reason == "grammar_unsatisfied"
        assert f"ended at {why} before it satisfied the job's JSON schema" in result.error.message
        assert result.text in ('{"', "{")
        with pytest.raises(ValueError):
            json.loads(result.text)


def test_a_stop_string_after_a_complete_output_still_ends_as_stop(tiny: LoadedModel) -> None:
    """The cut text itself is checked (the matcher has read the stop string too): an
    output the grammar accepts without the stop string's text is a `stop`."""
    from tokenfleet.grammar import GrammarEnd, unmet

    spec = Structured(kind="regex", value="ab(;cd)?")
    matcher = engine(tiny).grammars.matcher(spec)
    assert all(matcher.consume_token(b) for b in b"ab;")
    assert unmet(matcher, spec, "a stop string", "ab") is None  # "ab" matches alone
    cut = unmet(matcher, spec, "a stop string", "a")
    assert cut is not None and cut.reason == GrammarEnd.UNSATISFIED
    assert unmet(matcher, spec, "a stop token", None) is not None  # "ab;" does not match


def test_the_library_giving_up_mid_generation_is_a_named_refusal(tiny: LoadedModel) -> None:
    """A schema the probe cannot refuse up front (a free string comes first), whose every
    instance then nests without end: the library gives up mid-way. That ends the job
    `rejected`, `grammar_failed`, with the library's word (this was `error`,
    postprocess_error: a 500, and redelivered as an engine failure)."""
    loop = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 2},
            "x": {"$ref": "#/$defs/loop"},
        },
        "required": ["a", "x"],
        "$defs": {
            "loop": {
                "type": "object",
                "properties": {"y": {"$ref": "#/$defs/loop"}},
                "required": ["y"],
            }
        },
    }
    job = GenerationRequest(
        job_id="loop",
        prompt="x",
        max_new_tokens=100,
        sampling=SamplingParams(temperature=1.0, seed=3),
        structured=Structured(kind="json_schema", value=json.dumps(loop)),
    )
    result = run(engine(tiny), [job])["loop"].result
    assert result.finish_reason is FinishReason.REJECTED, result
    assert result.error is not None and result.error.reason == "grammar_failed"
    assert "Too many items" in result.error.message
    assert result.usage.completion_tokens >= len('{"a":"')
    assert result.text.startswith('{"a":"')
