"""The engine: admission + scheduler + job lifecycle, one tick at a time, no Redis, no torch.

    engine = Engine(load_model("tiny-random"), EngineConfig())  # or Engine(runner, ...)
    engine.submit(GenerationRequest(prompt="hi", max_new_tokens=8))
    while engine.has_work:
        out = engine.step()   # token events of this tick, then jobs that ended

A tick is ONE `ModelRunner.execute` (one forward pass and one batched sample):
every decoding session's next token, then bounded prefill chunks of new
sessions (see `scheduler.py`). The engine only talks to the runner
(`worker/runner.py`); a `LoadedModel` is wrapped in `TorchRunner`. A failure
inside the runner is retried with each session alone, so one bad job fails
itself, not its batch. Every terminal outcome (finish, rejection, cancel,
deadline, error) comes out of `step()` as a `Finished`, and the engine times
its own steps and the runner's share of them (`EngineStats`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

from tokenfleet.admission import Admission, AdmissionDecision, AdmissionRequest, NodeBudget
from tokenfleet.grammar import Grammars, MaskJobs
from tokenfleet.keys import BANDS, Band
from tokenfleet.kv.prefix import cache_scope, chain_hashes, root_hash
from tokenfleet.model.chat import render_chat
from tokenfleet.model.detokenizer import IncrementalDetokenizer
from tokenfleet.protocol import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    ErrorInfo,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
)
from tokenfleet.reasons import QUEUE_DEADLINE_REASON, AdmissionReason, FinishReason
from tokenfleet.seam import (
    DecodeStep,
    ModelRunner,
    PromptLogprobs,
    Sampled,
    SeqState,
    SeqStatus,
    TickPlan,
    TokenLogprobs,
)
from tokenfleet.tools import chat_input, tool_format, tool_grammar
from tokenfleet.worker.bands import BandPolicy, FairnessConfig, band_of
from tokenfleet.worker.logprobs import TokenTexts
from tokenfleet.worker.scheduler import Scheduler, SchedulerConfig
from tokenfleet.worker.session import Finished, Outbox, Session, terminal
from tokenfleet.worker.telemetry import EngineStats
from tokenfleet.worker.threads import ThreadGovernor

if TYPE_CHECKING:
    from tokenfleet.model.build import LoadedModel

__all__ = ["Engine", "EngineConfig", "Finished", "StepOutput"]

MiB = 1024 * 1024
FaultHook = Callable[[Session], None]
Pick = tuple[int, TokenLogprobs | None]  # a sampled token and its logprobs (when asked)


@dataclass(frozen=True)
class EngineConfig:
    """A node's knobs; `budget()` turns them into a validated `NodeBudget` for a model."""

    kv_budget_bytes: int = 256 * MiB
    max_active: int = 64
    max_batch_size: int = 32
    max_prefill_tokens_per_tick: int = 256
    max_waiting: int = 4
    block_size: int = 16
    scratch_budget_bytes: int | None = None  # None: enough for max_active sessions' worst case
    prefix_cache: bool = True  # share full KV blocks between jobs with the same prefix
    fairness: FairnessConfig = field(default_factory=FairnessConfig)  # between bands

    def budget(self, runner: ModelRunner) -> NodeBudget:
        layout = runner.spec.kv_layout(self.block_size)
        max_tokens = layout.num_blocks_for_budget(self.kv_budget_bytes) * self.block_size
        per_session = runner.scratch_bytes(max(1, max_tokens))
        total = self.scratch_budget_bytes
        if total is None:
            total = per_session * self.max_active
        return NodeBudget(
            weight_bytes=runner.spec.weight_bytes,
            kv_budget_bytes=self.kv_budget_bytes,
            scratch_per_session_bytes=min(per_session, total),
            scratch_total_bytes=total,
            max_active=self.max_active,
            max_batch_size=self.max_batch_size,
            max_prefill_tokens_per_tick=self.max_prefill_tokens_per_tick,
            layout=layout,
            max_waiting=self.max_waiting,
            session_cap=runner.spec.max_session_tokens,
        )


@dataclass
class StepOutput:
    tokens: list[TokenEvent] = field(default_factory=list)  # in session order, by index
    finished: list[Finished] = field(default_factory=list)
    decode_tokens: int = 0
    prefill_tokens: int = 0


class Engine:
    def __init__(
        self,
        model: ModelRunner | LoadedModel,
        config: EngineConfig | None = None,
        *,
        worker: str | None = None,
        clock: Callable[[], float] = time.time,
        fault: FaultHook | None = None,
        threads: ThreadGovernor | None = None,
    ) -> None:
        self.runner = _as_runner(model)
        self.spec = self.runner.spec
        self.tokenizer = self.runner.tokenizer
        self.config = config or EngineConfig()
        self.budget = self.config.budget(self.runner)
        self.worker = worker
        self.clock = clock
        self.fault = fault  # fault injection for tests: raise inside the forward of a session
        self.threads = threads  # fits the CPU thread count to the free cores between ticks
        self.grammars = Grammars(self.tokenizer, self.spec.vocab_size)  # structured output
        self.token_texts = TokenTexts(self.tokenizer)  # for logprobs' token texts
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        self.tool_format = tool_format(template)  # how its model writes tool calls
        self.admission = Admission(self.budget)
        self.blocks = self.budget.new_block_manager(
            prefix_cache=self.config.prefix_cache and self.spec.shares_prefix
        )
        self.runner.allocate_kv(self.budget.num_kv_blocks, self.budget.layout.block_size)
        self.bands = BandPolicy(self.config.fairness)  # the one order of waiting jobs
        self.scheduler = Scheduler(
            SchedulerConfig(self.budget.max_batch_size, self.budget.max_prefill_tokens_per_tick),
            self.blocks,
            rank=lambda job_id: self.bands.rank(self.sessions[job_id]),  # prefill order
        )
        self.stats = EngineStats(self.budget.max_batch_size)
        self.sessions: dict[str, Session] = {}  # admitted: in the scheduler
        self.waiting: list[Session] = []  # queued locally until they fit (arrival order)
        self._ended: list[Finished] = []  # outcomes decided between ticks
        self._outboxes: dict[str, Outbox] = {}  # per job until its outcome is decided
        self._runner_s = 0.0  # runner time of the step in progress
        # Mean prompt length of admitted jobs (moving average): how many jobs one tick's
        # prefill budget starts, for `room()`. Starts at two blocks.
        self._prompt_mean = float(2 * self.budget.layout.block_size)

    # ---- jobs in ---------------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        *,
        resume_ids: list[int] | None = None,
        resume_logprobs: Sequence[TokenLogprob | None] | None = None,
        submitted_at: float | None = None,
        overflow: bool = False,
        cache_group: str | None = None,
        band: Band | None = None,
    ) -> AdmissionDecision:
        """Admit, queue or reject one job. `resume_ids` are tokens a previous worker
        already emitted (indices 0..n-1): the job continues at index n; `resume_logprobs`
        are what their events carried (so the job's result keeps them). Its cached
        prompt blocks are shared with its tenant's jobs only, or with those of every
        tenant in `cache_group` (the tenant's setting, as accept.lua reads it).

        A rejection is also returned by the next `step()` as a `Finished` with
        reason `rejected`, so a caller only has to publish what `step()` returns;
        except `rejected_duplicate`: the copy already here finishes the job. With
        `overflow`, a job that fits the node but finds the local waiting list full
        waits anyway (the caller read it because `room()` said so: a worker whose
        node is busy is no reason to fail a job it has taken). `band`: the band the job
        waited in, which it runs in (None: the one its request names).
        """
        now = self.clock()
        try:
            session = self._new_session(request, submitted_at or now)
        except ValueError as exc:
            self._new_outbox(request.job_id, Outbox([]))
            return self._reject(request, AdmissionReason.REJECTED_INVALID, str(exc), now)
        self._new_outbox(request.job_id, Outbox(session.events, len(resume_ids or [])))
        session.cache_scope = cache_scope(request.tenant, cache_group)
        if band is not None:
            session.band = band.rank
        resumed = resume_ids or []
        carried = resume_logprobs if resume_logprobs is not None else [None] * len(resumed)
        for token, logprobs in zip(resumed, carried, strict=True):
            _, ended = session.accept(token, logprobs)
            if ended is not None:  # everything was emitted; only the finish event is missing
                self._end(session, ended, now)
                return AdmissionDecision(AdmissionReason.ADMITTED, "resumed job was complete")
        if _queue_expired(session, now):
            self._end(session, FinishReason.DEADLINE, now, _QUEUE_DEADLINE)
            return AdmissionDecision(AdmissionReason.ADMITTED, "its queue deadline had passed")
        decision = self.admission.decide(
            self._admission_request(session),
            active_ids=self.sessions.keys(),
            waiting_ids={s.job_id for s in self.waiting},
            kv=self.blocks,
            scratch_in_use=self.scratch_in_use,
        )
        if decision.reason is AdmissionReason.ADMITTED:
            self._start(session, now)
        elif decision.reason is AdmissionReason.QUEUED:
            self._wait(session, now)
        elif decision.reason is AdmissionReason.REJECTED_QUEUE_FULL and overflow:
            self._wait(session, now)
            decision = AdmissionDecision(AdmissionReason.QUEUED, decision.message)
        elif decision.reason is AdmissionReason.REJECTED_DUPLICATE:
            # The job is already here: its one terminal event belongs to that copy.
            self.stats.record_rejection(decision.reason)
        else:
            self._reject(request, decision.reason, decision.message, now)
        return decision

    def _new_outbox(self, job_id: str, box: Outbox) -> None:
        """A job's outbox, unless one for a copy still running here exists (that copy's
        outcome is the job's; the new one is rejected as a duplicate)."""
        known = self._outboxes.get(job_id)
        if known is None or known.end is not None:
            self._outboxes[job_id] = box

    def _wait(self, session: Session, now: float) -> None:
        """Queue locally; `self.bands` says which waiting job starts next."""
        session.waiting_since = now
        self.waiting.append(session)

    def cancel(self, job_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """End a job now (freeing its KV); its `Finished` comes out of the next `step()`."""
        now = self.clock()
        session = self.sessions.get(job_id)
        if session is None:
            session = next((s for s in self.waiting if s.job_id == job_id), None)
            if session is None:
                return False
        self._end(session, reason, now)
        return True

    def drop(self, job_id: str) -> bool:
        """Forget a job this node lost (another worker owns it now): free its KV and
        stop computing it, with no terminal outcome (that belongs to the new owner)."""
        self._outboxes.pop(job_id, None)
        session = self.session(job_id)
        if session is None:
            self._ended = [f for f in self._ended if f.job_id != job_id]
            return False
        self._remove(session)
        self._ended = [f for f in self._ended if f.job_id != job_id]
        self.stats.record_lost()
        return True

    def outbox(self, job_id: str) -> Outbox | None:
        """What is to be published for a job submitted here: its token events, then its
        outcome (`end`, set the moment the engine decides it). The
        caller keeps it; the engine forgets it once `step()` returned the outcome (or
        the job was dropped or given back)."""
        return self._outboxes.get(job_id)

    def session(self, job_id: str) -> Session | None:
        """The job's session while it is admitted or waiting here (it owns the job's
        emitted tokens and their texts)."""
        found = self.sessions.get(job_id)
        if found is None:
            found = next((s for s in self.waiting if s.job_id == job_id), None)
        return found

    def room(self) -> int:
        """How many more jobs to pull now: free slots, but only as many jobs as the coming
        tick's prefill budget can start (judged by the mean prompt length seen so far),
        plus the local waiting list's free places. A job nobody here can start soon is
        better left in the fleet's queue, where an idle worker takes it: a burst spreads
        over the fleet instead of piling onto the first reader."""
        free = self.admission.room(
            active_count=len(self.sessions), waiting_count=len(self.waiting), kv=self.blocks
        )
        backlog = self.scheduler.prefill_backlog + sum(len(s.prompt_ids) for s in self.waiting)
        spare = max(0, self.budget.max_prefill_tokens_per_tick - backlog)
        startable = math.ceil(spare / max(1.0, self._prompt_mean))
        not_started = len(self.waiting) + self.scheduler.num_unstarted
        cap = startable + self.budget.max_waiting - not_started
        return max(0, min(free, cap))

    # ---- one tick ----------------------------------------------------------------

    def step(self) -> StepOutput:
        """Expire deadlines, start waiting jobs that fit, run one tick, post-process."""
        step_started = time.perf_counter()
        self._runner_s = 0.0
        now = self.clock()
        self._expire(now)
        self._promote(now)
        out = StepOutput()
        plan = self.scheduler.schedule()
        if not plan.is_empty:
            if self.threads is not None:
                self.threads.poll()
            started = time.perf_counter()
            self._run_tick(plan, out)
            self.stats.record_tick(
                time.perf_counter() - started,
                decode_batch=len(plan.decode),
                prefill_tokens=plan.num_prefill_tokens,
                decode_tokens=plan.num_decode_tokens,
            )
            out.decode_tokens, out.prefill_tokens = plan.num_decode_tokens, plan.num_prefill_tokens
        out.finished.extend(self._ended)
        for done in self._ended:
            self._outboxes.pop(done.job_id, None)
        self._ended = []
        self.stats.record_step(time.perf_counter() - step_started, self._runner_s)
        return out

    def _run_tick(self, plan: TickPlan, out: StepOutput) -> None:
        picks = self._execute(plan)  # session id -> sampled token, its logprobs
        now = self.clock()
        generated = [0] * len(BANDS)  # sampled tokens per band
        for sid, (token, sampled) in picks.items():
            session = self.sessions[sid]
            if session.max_new_tokens == 0:  # prefill only: its prompt is all it wanted
                self._end(session, FinishReason.LENGTH, now)
                continue
            generated[band_of(session)] += 1
            try:
                logprobs = None if sampled is None else self.token_texts.logprob(token, sampled)
                event, ended = session.accept(token, logprobs)
            except Exception as exc:  # one job's text handling must not take the batch down
                self._end(session, FinishReason.ERROR, now, _error("postprocess", exc))
                continue
            if event is not None:
                if session.first_token_at is None:
                    session.first_token_at = now
                out.tokens.append(event)
            if ended is not None:
                self._end(session, ended, now)
        self.scheduler.complete_tick(plan)  # advances the sessions still running
        self.bands.record_tick(generated, (*self.sessions.values(), *self.waiting))

    def _execute(self, plan: TickPlan) -> dict[str, Pick]:
        """Each sampling session's next token; on failure, retry entries one by one and
        fail only the sessions whose own execution fails."""
        try:
            return self._run_runner(plan)
        except Exception:
            pass
        tokens: dict[str, Pick] = {}
        now = self.clock()
        for entry in plan.entries:
            alone = (
                TickPlan([entry], []) if isinstance(entry, DecodeStep) else TickPlan([], [entry])
            )
            try:
                tokens.update(self._run_runner(alone))
            except Exception as exc:
                session = self.sessions[entry.seq.session_id]
                self._end(session, FinishReason.ERROR, now, _error("engine", exc))
        return tokens

    def _run_runner(self, plan: TickPlan) -> dict[str, Pick]:
        ids = plan.sampling_ids
        sampling = {sid: self.sessions[sid].sampling for sid in ids}
        started = time.perf_counter()
        try:
            if self.fault is not None:
                for entry in plan.entries:
                    self.fault(self.sessions[entry.seq.session_id])
            structured = {sid: m for sid in ids if (m := self.sessions[sid].matcher) is not None}
            if structured:  # masks computed on a thread while the forward runs
                masks = MaskJobs(structured)
                try:
                    tokens = self.runner.execute(plan, sampling, masks)
                finally:
                    masks.settle()
            else:
                tokens = self.runner.execute(plan, sampling)
        finally:
            self._runner_s += time.perf_counter() - started
        if isinstance(tokens, Sampled):
            for sid, found in tokens.prompt.items():
                self._record_prompt(self.sessions[sid], found)
            return dict(zip(ids, zip(tokens.tokens, tokens.logprobs, strict=True), strict=True))
        return {sid: (token, None) for sid, token in zip(ids, tokens, strict=True)}

    def _record_prompt(self, session: Session, found: PromptLogprobs) -> None:
        prompt, texts = session.prompt_ids, self.token_texts
        session.record_prompt(
            found.first,
            [texts.logprob(prompt[found.first + i], lp) for i, lp in enumerate(found.logprobs)],
        )

    # ---- lifecycle -----------------------------------------------------------------

    def _new_session(self, request: GenerationRequest, submitted_at: float) -> Session:
        tokenizer = self.tokenizer
        if request.prompt_ids is not None:
            prompt_ids = list(request.prompt_ids)
        elif tokenizer is None:
            raise ValueError("this model has no tokenizer: send prompt_ids instead of text")
        elif request.messages is not None:
            chat = chat_input(request, tokenizer.chat_template)
            prompt = render_chat(tokenizer, chat.turns, tools=chat.tools)  # ChatTemplateError
            prompt_ids = tokenizer.encode(prompt)
        else:
            prompt_ids = tokenizer.encode(request.prompt or "")
        vocab = self.spec.vocab_size
        if not prompt_ids:
            raise ValueError("the prompt encodes to zero tokens")
        bad = [t for t in prompt_ids if t >= vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab})")
        limit = self.spec.max_context
        if len(prompt_ids) + request.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens})"
                f" exceeds the model's context length ({limit})"
            )
        s = request.sampling
        if s.prompt_logprobs is not None:
            entries = len(prompt_ids) * (s.prompt_logprobs + 1)
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise ValueError(
                    f"the prompt's logprobs would be {len(prompt_ids):,} tokens x "
                    f"{s.prompt_logprobs + 1} entries, over MAX_PROMPT_LOGPROB_ENTRIES="
                    f"{MAX_PROMPT_LOGPROB_ENTRIES:,}: ask fewer top logprobs or a shorter prompt"
                )
        stop_ids = frozenset(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self.spec.eos_token_ids
        detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer, prompt_ids)
        # a forced call's grammar wins over `structured` (the call is the whole output)
        grammar = tool_grammar(request, self.tool_format) or request.structured
        matcher = None
        if grammar is not None:  # GrammarError: rejected_invalid
            matcher = self.grammars.matcher(grammar)
        bias = s.bias_pairs()
        if bias and bias[-1][0] >= vocab:
            raise ValueError(
                f"logit_bias token id {bias[-1][0]} is outside the vocabulary (size {vocab})"
            )
        sampling = replace(  # validated again (ValueError: rejected_invalid)
            self.spec.sampling_defaults.resolve(s.temperature, s.top_k, s.top_p, s.seed),
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            logit_bias=bias,
            logprobs=s.logprobs,
        )
        session = Session(
            request=request,
            prompt_ids=prompt_ids,
            sampling=sampling,
            detok=detok,
            stop_ids=stop_ids,
            submitted_at=submitted_at,
            scratch_bytes=self.runner.scratch_bytes(len(prompt_ids) + request.max_new_tokens),
            matcher=matcher,
            grammar=grammar,
        )
        if session.echoes:  # the prompt as its client sent it, else as the model reads it
            session.first_token_text = self.token_texts.text(prompt_ids[0])
            session.prompt_text = request.prompt or (
                "" if tokenizer is None else tokenizer.decode(prompt_ids)
            )
        return session

    def _admission_request(self, session: Session) -> AdmissionRequest:
        return AdmissionRequest(
            job_id=session.job_id,
            prompt_tokens=len(session.prompt_ids),
            max_new_tokens=session.max_new_tokens,
            scratch_bytes=session.scratch_bytes,
            block_hashes=tuple(self._block_hashes(session)),
        )

    def _hash_root(self, session: Session) -> bytes | None:
        """None: the session neither shares nor registers cached blocks (no prefix cache,
        or a job asking for its prompt's logprobs: every prompt position is computed)."""
        if not self.blocks.prefix_cache or session.echoes:
            return None
        return root_hash(self.spec.cache_identity, session.cache_scope, session.request.cache_salt)

    def _block_hashes(self, session: Session) -> list[bytes]:
        """Addresses of the full blocks before the last known token (prompt + emitted:
        a resumed job looks up what it re-prefills), computed once per session."""
        if session.block_hashes is None:
            root = self._hash_root(session)
            known = session.prompt_ids + session.emitted
            size = self.budget.layout.block_size
            session.block_hashes = (
                [] if root is None else chain_hashes(known[: len(known) - 1], size, root)
            )
        return session.block_hashes

    def _start(self, session: Session, now: float) -> None:
        # The scheduler reads the session's emitted tokens (resumed ones included) from
        # the same list the session appends to: one record of the job's output.
        session.seq = SeqState(
            session.job_id,
            session.prompt_ids,
            session.max_new_tokens,
            output_ids=session.emitted,
            hash_root=self._hash_root(session),
            block_hashes=list(self._block_hashes(session)),
            prompt_logprobs=session.request.sampling.prompt_logprobs,
        )
        self.sessions[session.job_id] = session
        try:
            self.scheduler.add(session.seq)  # in prefill order (self.bands.rank)
        except BaseException:
            del self.sessions[session.job_id]
            raise
        self.bands.on_start(session)
        if session.admitted_at is None:  # a preempted session keeps its first admission
            session.admitted_at = now
        self._prompt_mean += 0.2 * (len(session.prompt_ids) - self._prompt_mean)

    def _promote(self, now: float) -> None:
        """Start waiting jobs in the bands' order (bands.py) while they fit; a head that
        does not fit takes the place of a running job that ranks below it (`_preempt`)."""
        while self.waiting:
            head = self.bands.next_to_start(self.waiting)
            assert head is not None
            fits = self.admission.fits_now(
                self._admission_request(head),
                active_count=len(self.sessions),
                kv=self.blocks,
                scratch_in_use=self.scratch_in_use,
            )
            if fits:
                self.waiting.remove(head)
                self._start(head, now)
            elif not self._preempt(self.bands.rank(head), now):
                return

    def _preempt(self, rank: int, now: float) -> bool:
        """Put back one running session that ranks below `rank` (`BandPolicy.victim`) to
        wait: its KV is freed (its full blocks stay in the prefix cache), and it later
        resumes from prompt + emitted tokens, recomputing their KV, with the same session
        (its events, sampler stream, grammar state). False when there is none."""
        victim = self.bands.victim(rank, self.sessions.values())
        if victim is None:
            return False
        self._remove(victim)
        victim.seq = None
        victim.block_hashes = None  # prompt + what it emitted: looked up again
        victim.preemptions += 1
        self._wait(victim, now)
        self.stats.record_preemption()
        return True

    def interactive_room(self) -> int:
        """How many interactive jobs to pull beyond `room()`: as many as there are running
        sessions an interactive job may put back (less the interactive jobs already
        waiting here), at most the local waiting list's size."""
        lower = sum(
            1
            for s in self.sessions.values()
            if self.bands.rank(s) > 0 and not self.bands.protected(s)
        )
        waiting = sum(1 for s in self.waiting if band_of(s) == 0)
        return max(0, min(lower, self.budget.max_waiting) - waiting)

    def overdue(self) -> list[str]:
        """Jobs waiting here, not started, for `fairness.hold_s` or longer: the worker
        gives them back to their streams (`give_back`), for a worker that can start them."""
        return [s.job_id for s in self.bands.overdue(self.waiting, self.clock())]

    def give_back(self, job_id: str) -> bool:
        """Forget a waiting job the worker has put back in its stream: no terminal
        outcome (the next worker's), its emitted tokens stay published."""
        session = next((s for s in self.waiting if s.job_id == job_id), None)
        if session is None:
            return False
        self.waiting.remove(session)
        self._outboxes.pop(job_id, None)
        self.stats.record_returned()
        return True

    def _expire(self, now: float) -> None:
        """End jobs past their deadline, and jobs not started yet past their queue deadline
        (before any prefill is spent on them)."""
        expired: list[tuple[Session, ErrorInfo | None]] = []
        for s in (*self.sessions.values(), *self.waiting):
            if s.request.deadline is not None and s.request.deadline <= now:
                expired.append((s, None))
            elif _queue_expired(s, now) and (s.seq is None or s.seq.status is SeqStatus.WAITING):
                expired.append((s, _QUEUE_DEADLINE))
        for session, error in expired:
            self._end(session, FinishReason.DEADLINE, now, error)

    def _end(
        self, session: Session, reason: FinishReason, now: float, error: ErrorInfo | None = None
    ) -> None:
        """Take a session out of the engine (KV freed) and queue its terminal outcome."""
        self._remove(session)
        self.stats.record_finish(reason)
        self._decided(session.finish(reason, now, self.worker, error))

    def _decided(self, finished: Finished) -> None:
        """A job's outcome: out of the next `step()`, and into its outbox."""
        self._ended.append(finished)
        box = self._outboxes.get(finished.job_id)
        if box is not None:
            box.end = finished  # forgotten here once `step()` returned the outcome

    def _remove(self, session: Session) -> None:
        """Free what the session holds here: its KV (scheduler) and runner state."""
        if self.sessions.pop(session.job_id, None) is not None:
            self.scheduler.finish(session.job_id)
            session.recomputed = self.runner.recomputed(session.job_id)
            self.blocks.stats.recomputed_tokens += session.recomputed
            self.runner.release(session.job_id)
        elif session in self.waiting:
            self.waiting.remove(session)

    def _reject(
        self, request: GenerationRequest, reason: AdmissionReason, message: str, now: float
    ) -> AdmissionDecision:
        self.stats.record_rejection(reason)
        error = ErrorInfo(reason=str(reason), message=message[:4096])
        self._decided(terminal(request.job_id, FinishReason.REJECTED, self.worker, error=error))
        return AdmissionDecision(reason, message)

    # ---- state -------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.sessions or self.waiting or self._ended)

    @property
    def scratch_in_use(self) -> int:
        return sum(s.scratch_bytes for s in self.sessions.values())

    @property
    def kv_used_bytes(self) -> int:
        """KV held by sessions (a shared block once); cached-but-free blocks are not."""
        return self.blocks.num_in_use_blocks * self.budget.layout.bytes_per_block

    @property
    def kv_cached_bytes(self) -> int:
        """Free KV blocks that still hold a cached prefix (reclaimable)."""
        return self.blocks.num_cached_blocks * self.budget.layout.bytes_per_block

    @property
    def max_job_tokens(self) -> int:
        """The largest prompt + max_new_tokens this node could ever hold."""
        return self.budget.max_tokens_per_session

    def telemetry(self) -> dict[str, object]:
        """JSON-safe snapshot: sessions, occupancy, KV/scratch pressure, rates, tick times."""
        snap: dict[str, object] = dict(
            self.stats.snapshot(
                active=len(self.sessions),
                waiting=len(self.waiting),
                kv_used_bytes=self.kv_used_bytes,
                kv_budget_bytes=self.budget.num_kv_blocks * self.budget.layout.bytes_per_block,
                scratch_used=self.scratch_in_use,
                scratch_budget=self.budget.scratch_total_bytes,
            )
        )
        snap["weight_bytes"] = self.budget.weight_bytes
        snap["max_job_tokens"] = self.max_job_tokens
        snap["prefix_cache"] = self.blocks.prefix_cache
        if self.blocks.prefix_cache:
            snap["kv_cached_bytes"] = self.kv_cached_bytes
            snap["kv_cached_blocks"] = self.blocks.num_cached_blocks
            snap.update(self.blocks.stats.as_fields())
        if self.threads is not None:
            snap.update(self.threads.telemetry())
        snap.update(self.bands.telemetry())
        return snap


_QUEUE_DEADLINE = ErrorInfo(
    reason=QUEUE_DEADLINE_REASON, message="no worker started the job before its queue deadline"
)


def _as_runner(model: ModelRunner | LoadedModel) -> ModelRunner:
    if hasattr(model, "execute"):
        return cast(ModelRunner, model)
    from tokenfleet.model.torch_runner import TorchRunner

    return TorchRunner(model)  # not a runner: a LoadedModel


def _queue_expired(session: Session, now: float) -> bool:
    deadline = session.request.queue_deadline
    return deadline is not None and deadline <= now


def _error(where: str, exc: BaseException) -> ErrorInfo:
    return ErrorInfo(reason=f"{where}_error", message=f"{type(exc).__name__}: {exc}"[:4096])
