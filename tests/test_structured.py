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
from tokenfleet.protocol import GenerationRequest, SamplingParams, Structured
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
