"""The engine driven through the `ModelRunner` seam by a fake, pure-Python runner.

`PagedFakeRunner` behaves like a model over a paged KV cache: it writes every
planned token into the slot its block table gives, and a session's next token is
a function of the context it reads back through its own block table. So if the
scheduler ever planned overlapping blocks, wrong positions or a missed token,
the outputs would differ from `reference`, which computes them from the prompt
alone. The engine runs with no torch at all (one test proves it in a subprocess
where `import torch` fails).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

from tests.helpers.engine_runs import request, run_all
from tokenfleet.reasons import FinishReason
from tokenfleet.seam import DecodeStep, ModelSpec, ResolvedSampling, TickPlan
from tokenfleet.worker.engine import Engine, EngineConfig

VOCAB = 97
SPEC = ModelSpec(
    num_layers=1,
    num_kv_heads=1,
    head_dim=1,
    kv_dtype_bytes=4,
    weight_bytes=1000,
    vocab_size=VOCAB,
    max_context=256,
    eos_token_ids=frozenset(),
)


def next_token(context: list[int], seed: int) -> int:
    """The fake model: a deterministic function of the whole context (and the seed)."""
    acc = seed % VOCAB
    for i, t in enumerate(context):
        acc = (acc * 31 + t * (i + 7)) % 1_000_003
    return acc % VOCAB


def reference(prompt: list[int], n: int, seed: int = 0) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + out, seed))
    return out


class PagedFakeRunner:
    def __init__(self, spec: ModelSpec = SPEC, *, poison: int | None = None) -> None:
        self._spec = spec
        self.poison = poison  # a prompt's first token that makes its execution fail
        self.slots: list[int | None] = []
        self.block_size = 0
        self.executes = 0
        self.released: list[str] = []
        self.live: set[str] = set()

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def tokenizer(self) -> None:
        return None

    def scratch_bytes(self, context_len: int) -> int:
        return 8 * context_len

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.slots = [None] * (num_blocks * block_size)
        self.block_size = block_size

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: TickPlan, sampling: Mapping[str, ResolvedSampling]) -> list[int]:
        self.executes += 1
        assert list(sampling) == plan.sampling_ids
        if self.poison is not None and any(
            e.seq.prompt_ids[0] == self.poison for e in plan.entries
        ):
            raise RuntimeError("poisoned row")
        tokens: list[int] = []
        for entry in plan.entries:
            sid = entry.seq.session_id
            self.live.add(sid)
            if isinstance(entry, DecodeStep):
                fed, start, samples = [entry.token_id], entry.position, True
            else:
                fed, start, samples = entry.token_ids, entry.start, entry.samples
            for i, token in enumerate(fed):
                self.slots[self._slot(entry.block_table, start + i)] = token
            if samples:
                context = [
                    self.slots[self._slot(entry.block_table, p)] for p in range(entry.context_len)
                ]
                assert None not in context, f"{sid} reads a slot never written"
                tokens.append(next_token(context, sampling[sid].seed))  # type: ignore[arg-type]
        return tokens

    def recomputed(self, session_id: str) -> int:
        return 0

    def release(self, session_id: str) -> None:
        self.released.append(session_id)
        self.live.discard(session_id)


def test_batched_chunked_paged_outputs_equal_the_reference() -> None:
    runner = PagedFakeRunner()
    config = EngineConfig(
        kv_budget_bytes=64 * 1024, max_batch_size=3, max_prefill_tokens_per_tick=5, block_size=4
    )
    engine = Engine(runner, config)
    prompts = {f"j{i}": [(i * 13 + k) % VOCAB for k in range(3 + 2 * i)] for i in range(8)}
    for i, (job_id, prompt) in enumerate(prompts.items()):
        engine.submit(request(job_id, prompt, 6 + i, seed=i))
    got = run_all(engine)
    assert got == {
        job_id: reference(prompt, 6 + i, seed=i)
        for i, (job_id, prompt) in enumerate(prompts.items())
    }
    # Every session's runner state was released, and the engine freed all its KV.
    assert sorted(runner.released) == sorted(prompts) and not runner.live
    assert engine.kv_used_bytes == 0 and engine.blocks.num_reserved_blocks == 0


def test_resumed_job_continues_where_the_emitted_tokens_end() -> None:
    prompt = [5, 6, 7, 8, 9]
    want = reference(prompt, 10)
    engine = Engine(PagedFakeRunner(), EngineConfig(kv_budget_bytes=64 * 1024, block_size=4))
    engine.submit(request("r", prompt, 10), resume_ids=want[:4])
    [done] = [f for _ in range(50) for f in engine.step().finished][:1]
    assert done.result.token_ids == want  # the result holds every token, resumed ones too
    assert done.result.usage.completion_tokens == 10


def test_a_failing_session_fails_alone_and_the_batch_goes_on() -> None:
    runner = PagedFakeRunner(poison=66)
    engine = Engine(runner, EngineConfig(kv_budget_bytes=64 * 1024, block_size=4))
    engine.submit(request("good", [1, 2, 3], 5))
    engine.submit(request("bad", [66, 2, 3], 5))
    ends = {}
    for _ in range(50):
        for f in engine.step().finished:
            ends[f.job_id] = f.result
        if not engine.has_work:
            break
    assert ends["bad"].finish_reason is FinishReason.ERROR
    assert ends["bad"].error is not None and "poisoned row" in ends["bad"].error.message
    assert ends["good"].finish_reason is FinishReason.LENGTH
    assert ends["good"].token_ids == reference([1, 2, 3], 5)
    assert "bad" in runner.released and not runner.live


def test_the_engine_times_its_own_steps_and_the_runners_share() -> None:
    runner = PagedFakeRunner()
    engine = Engine(runner, EngineConfig(kv_budget_bytes=64 * 1024, block_size=4))
    engine.submit(request("a", [1, 2, 3], 8))
    run_all(engine)
    snap = engine.telemetry()
    assert runner.executes > 0 and snap["ticks"] == runner.executes
    assert isinstance(snap["step_s"], float) and isinstance(snap["runner_s"], float)
    assert snap["step_s"] >= snap["runner_s"] > 0


def test_the_engine_runs_with_torch_unimportable() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from tests.test_runner_seam import PagedFakeRunner, reference, request, run_all
        from tokenfleet.worker.engine import Engine, EngineConfig
        engine = Engine(PagedFakeRunner(), EngineConfig(kv_budget_bytes=64 * 1024, block_size=4))
        engine.submit(request("a", [1, 2, 3], 7))
        assert run_all(engine) == {"a": reference([1, 2, 3], 7)}
        assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules
                       if sys.modules[m] is not None)
        print("ok")
        """
    )
    proc = subprocess.run(  # `python -c` in the repository: `tests` imports as a package
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
