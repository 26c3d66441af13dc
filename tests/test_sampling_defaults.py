"""A model's generation_config.json sampling defaults: read at load, advertised in the
worker hash, applied to what a job leaves unset (in the engine and in the gateway)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.helpers.models import make_hf_llama, save_hf_llama
from tests.test_engine import run_jobs
from tokenfleet.fleet import ServedModel, decode_worker
from tokenfleet.model import LoadedModel, load_model
from tokenfleet.model.torch_runner import TorchRunner
from tokenfleet.openai.models import ChatCompletionRequest
from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.seam import ResolvedSampling, SamplingDefaults

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "eos_token_id": 2}


def test_generation_config_values_are_read_and_bad_ones_left_out() -> None:
    assert SamplingDefaults.from_generation_config(QWEN_LIKE) == SamplingDefaults(0.7, 20, 0.8)
    assert SamplingDefaults.from_generation_config({"eos_token_id": 2}) == SamplingDefaults()
    bad = {"temperature": -1, "top_k": "many", "top_p": 0.0}
    assert SamplingDefaults.from_generation_config(bad) == SamplingDefaults()
    assert SamplingDefaults(0.7, None, 0.8).as_fields() == {"temperature": 0.7, "top_p": 0.8}


def test_a_job_value_wins_then_the_model_default_then_greedy() -> None:
    model = SamplingDefaults(temperature=0.7, top_k=20)
    assert model.resolve(None, None, None, 5) == ResolvedSampling(0.7, 20, 1.0, 5)
    assert model.resolve(0.0, None, 0.9, 5) == ResolvedSampling(0.0, 20, 0.9, 5)
    assert SamplingDefaults().resolve(None, None, None, 5) == ResolvedSampling(0.0, 0, 1.0, 5)


@pytest.fixture(scope="module")
def with_defaults(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = save_hf_llama(make_hf_llama(seed=5), tmp_path_factory.mktemp("gen"))
    (folder / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    return load_model(str(folder), device="cpu")


def test_a_folder_loads_its_defaults_into_the_runner_spec(
    with_defaults: LoadedModel, tmp_path: Path
) -> None:
    assert with_defaults.sampling_defaults == SamplingDefaults(0.7, 20, 0.8)
    assert TorchRunner(with_defaults).spec.sampling_defaults == SamplingDefaults(0.7, 20, 0.8)
    plain = save_hf_llama(make_hf_llama(seed=5), tmp_path / "plain")
    assert load_model(str(plain), device="cpu").sampling_defaults == SamplingDefaults()
    (plain / "generation_config.json").write_text("{not json")
    assert load_model(str(plain), device="cpu").sampling_defaults == SamplingDefaults()


def _job(job_id: str, sampling: SamplingParams) -> GenerationRequest:
    return GenerationRequest(
        job_id=job_id,
        prompt_ids=[3, 17, 99, 4, 250],
        max_new_tokens=24,
        ignore_eos=True,
        sampling=sampling,
    )


def test_the_engine_applies_the_defaults_to_unset_fields_only(with_defaults: LoadedModel) -> None:
    explicit = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=11)
    requests = [
        _job("unset", SamplingParams(seed=11)),
        _job("explicit", explicit),
        _job("greedy", SamplingParams(temperature=0.0, seed=11)),
    ]
    run = run_jobs(with_defaults, requests)
    # the same model without defaults: unset means greedy
    bare = dataclasses.replace(with_defaults, sampling_defaults=SamplingDefaults())
    bare_run = run_jobs(bare, [_job("unset", SamplingParams(seed=11))])
    assert run.tokens["unset"] == run.tokens["explicit"]
    assert run.tokens["greedy"] == bare_run.tokens["unset"]
    assert run.tokens["unset"] != run.tokens["greedy"]  # the defaults really sample


def test_the_gateway_fills_unset_fields_from_the_model_then_openai() -> None:
    worker = decode_worker(
        "w1", {b"model": b'"m"', b"sampling_defaults": json.dumps({"temperature": 0.7}).encode()}
    )
    served = ServedModel("m", (worker,))
    assert served.sampling_defaults == {"temperature": 0.7}
    ask = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    sampling = ask.fleet_fields(8, served.sampling_defaults)["sampling"]
    assert sampling == {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": None}
    # no model default: OpenAI's temperature 1
    assert ask.fleet_fields(8, {})["sampling"]["temperature"] == 1.0
    told = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    )
    assert told.fleet_fields(8, served.sampling_defaults)["sampling"]["temperature"] == 0


def test_a_worker_advertises_its_defaults_and_serves_unset_jobs_with_them(
    redis_url: str, with_defaults: LoadedModel, tmp_path: Path
) -> None:
    from tests.test_worker_main import PREFIX, fleet_settings
    from tokenfleet.producer import Producer
    from tokenfleet.worker.main import build_worker

    folder = save_hf_llama(make_hf_llama(seed=5), tmp_path / "gen")
    (folder / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    worker = build_worker(
        fleet_settings(redis_url, model=str(folder), device="cpu", name="wm-defaults", burst=True)
    )
    assert worker.options.info["sampling_defaults"] == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    }
    producer = Producer.from_url(redis_url, prefix=PREFIX)
    args = dict(prompt_ids=[3, 17, 99, 4, 250], max_new_tokens=16, ignore_eos=True)
    unset = producer.submit(**args, sampling={"seed": 3})  # type: ignore[arg-type]
    explicit = producer.submit(
        **args,  # type: ignore[arg-type]
        sampling={"temperature": 0.7, "top_k": 20, "top_p": 0.8, "seed": 3},
    )
    greedy = producer.submit(**args, sampling={"temperature": 0.0})  # type: ignore[arg-type]
    assert worker.run() == 0
    tokens = {
        n: h.result(timeout=10).token_ids for n, h in [("u", unset), ("e", explicit), ("g", greedy)]
    }
    assert tokens["u"] == tokens["e"] != tokens["g"]
