"""tokenfleet against llama.cpp on SmolLM2-135M-Instruct: the same GGUF file, the same threads.

Usage: python bench/vs_llamacpp.py [--quick] [--rounds 6] [--threads 2]
                                   [--ours fp32,bf16] [--theirs q4_1,q8_0,f32]
                                   [--llamacpp-bin DIR] [--out bench/out/vs_llamacpp.json]
                                   [--plot docs/img/vs_llamacpp.png]

Speed, in interleaved rounds (tokenfleet then llama.cpp, then llama.cpp then tokenfleet,
... : ABBA, so neither side always runs first), min / median / max over the rounds and
the load average around each round:
  one stream  32 prompt tokens + 256 new, greedy, fixed length (eos ignored): tokens/s
              of generation, i.e. (new - 1) / (last token - first token), and end to end;
  8 streams   8 x (32 + 128) at once: aggregate generated tokens / wall time (submit to
              last token, prefill included);
  mixed       16 jobs at once, prompts 8-64 and 16-96 new tokens (`mixed_jobs`, seed 2):
              useful tokens / wall time, TTFT p50 / p99 from the common submit time.
tokenfleet runs in process (`Engine` + `TorchRunner`, the model from
`load_model("smollm2-135m-instruct", ...)`); llama.cpp as `llama-server -np N` (one per
scenario and file, started once, fed the very same token ids over /completion with
`ignore_eos`, `temperature: 0`, `cache_prompt: false`, streamed) and as
`llama-batched-bench` (the one-stream and 8-stream shapes; its prompts are dummy tokens).

Quality, once: greedy tokens of every variant against tokenfleet fp32 on fixed prompts,
and perplexity over bench/data/declaration_gettysburg.txt in windows of 512 tokens,
scored the way `llama-perplexity -c 512` scores them (bench/_perplexity.py), for our
variants and for llama.cpp's files through llama-perplexity itself. llama.cpp's programs
are driven by bench/_llamacpp.py; tables and plot: bench/vs_llamacpp_report.py.

llama.cpp comes from bench/build_llamacpp.sh (or --llamacpp-bin); without it only
tokenfleet is measured. Derived GGUF files (Q8_0, F32 from the shipped Q4_1) are cached
under ~/.cache/tokenfleet/vs_llamacpp/. `--quick` shrinks every length (< 2 min).

Differences that remain, on purpose or by necessity:
- llama.cpp's `ignore_eos` masks its end-of-generation ids (0, 2, 4 for SmolLM2) to -inf;
  tokenfleet's only keeps going past them. Speed runs are unaffected; the quality run
  notes it when tokenfleet fp32 emits one (tokens after it then differ by construction).
- llama.cpp keeps K/V in f16 (its default, serving and perplexity alike); tokenfleet in
  the model's dtype.
- llama-batched-bench runs dummy prompt tokens with no sampling and no HTTP: llama.cpp's
  bound. llama-server is measured by this process's client (threads, streamed SSE), on
  the same cores, as tokenfleet's `step()` caller is.

A variant is one entry of OURS / THEIRS below: a name, a line saying what it is, how to
load (or make) it, and for ours the llama.cpp file its ratio is taken against.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _common import (
    MIXED_N,
    MIXED_NEW,
    MIXED_PROMPT,
    TEXT,
    Job,
    Stream,
    burst_metrics,
    mixed_jobs,
    requests,
    text_body,
    uniform_jobs,
)
from _engine import engine_config, steps, submit_all
from _llamacpp import (
    CACHE,
    Server,
    batched_bench,
    derived_gguf,
    find_llamacpp,
    llama_perplexity,
    llamacpp_version,
    round_up,
)
from _perplexity import gguf_add_bos, our_perplexity
from _rounds import abba
from report import (
    Run,
    load_now,
    loadavg,
    markdown_table,
    outputs,
    parser,
    spreads,
    text_table,
)
from vs_llamacpp_report import plot, render

from tokenfleet.model import LoadedModel, load_model
from tokenfleet.model.smollm2 import PRESET
from tokenfleet.model.torch_runner import TorchRunner
from tokenfleet.worker.engine import Engine

REPO = Path(__file__).resolve().parent.parent

QUALITY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Photosynthesis is the process by which",
]


@dataclass(frozen=True)
class Settings:
    one: tuple[int, int]  # prompt, new
    multi: tuple[int, int, int]  # streams, prompt, new
    mixed_n: int
    mixed_prompt: tuple[int, int]
    mixed_new: tuple[int, int]
    quality_prompts: int
    quality_new: int
    ppl_ctx: int
    ppl_chunks: int | None  # None: every whole window of the text

    @classmethod
    def full(cls) -> Settings:
        mixed = (MIXED_N, MIXED_PROMPT, MIXED_NEW)
        return cls((32, 256), (8, 32, 128), *mixed, 4, 64, 512, None)

    @classmethod
    def quick(cls) -> Settings:
        return cls((16, 32), (8, 16, 16), 8, (8, 32), (4, 16), 2, 16, 512, 1)


# ---- variants -------------------------------------------------------------------------


@dataclass(frozen=True)
class Ours:
    about: str
    load: Callable[[], LoadedModel]  # load (and prepare: compile, quantize ...) the model
    versus: str  # the THEIRS entry its ratios are taken against


def eager(dtype: str, **options: Any) -> Callable[[], LoadedModel]:
    """`load_model` of the preset on the CPU, with `options` passed through."""
    return lambda: load_model(PRESET, dtype=dtype, device="cpu", **options)


def compiled(base: Callable[[], LoadedModel]) -> Callable[[], LoadedModel]:
    """`base`, then its decode path compiled (`tokenfleet.model.compiled.compile_model`)."""

    def load() -> LoadedModel:
        from tokenfleet.model.compiled import compile_model

        loaded = base()
        compile_model(loaded.model)
        return loaded

    return load


OURS: dict[str, Ours] = {
    "fp32": Ours("float32 weights (the Q4_1 file dequantized), eager", eager("float32"), "q4_1"),
    "bf16": Ours("bfloat16 weights (the Q4_1 file dequantized), eager", eager("bfloat16"), "q4_1"),
    # One line each, e.g.:
    "bf16-compiled": Ours("bfloat16, compiled forward", compiled(eager("bfloat16")), "q4_1"),
    "int8": Ours("int8 weights, bf16 activations", eager("auto", quant="int8"), "q8_0"),
    "int8-compiled": Ours(
        "int8 weights, compiled forward", compiled(eager("auto", quant="int8")), "q8_0"
    ),
    "int4": Ours("int4 weights, bf16 activations", eager("auto", quant="int4"), "q4_1"),
}


@dataclass(frozen=True)
class Theirs:
    about: str
    quant: str | None  # llama-quantize type made from the shipped file; None: as shipped

    def label(self, name: str) -> str:
        return name.upper()


THEIRS: dict[str, Theirs] = {
    "q4_1": Theirs("the shipped Q4_1 file", None),
    "q8_0": Theirs("Q8_0 re-quantized from the Q4_1 file (llama-quantize)", "Q8_0"),
    "f32": Theirs("F32 from the Q4_1 file: the very weights tokenfleet fp32 runs", "F32"),
}


def gguf_file(name: str, bin_dir: Path, log: Callable[[str], None]) -> Path:
    """The GGUF file of a THEIRS entry (made once with llama-quantize, cached)."""
    return derived_gguf(THEIRS[name].quant, bin_dir, log)


# ---- tokenfleet side ------------------------------------------------------------------


def engine_burst(loaded: LoadedModel, jobs: Sequence[Job]) -> list[Stream]:
    """All `jobs` submitted at once, stepped until done; a token's time is the end of the
    step that produced it (when a caller of `step()` gets it)."""
    engine = Engine(TorchRunner(loaded), engine_config(loaded, jobs, len(jobs)))
    reqs = requests(jobs)
    t0 = time.perf_counter()
    out = {r.job_id: Stream(t0, prompt_tokens=len(r.prompt_ids or [])) for r in reqs}
    submit_all(engine, reqs)
    for step in steps(engine):
        now = time.perf_counter()
        for event in step.tokens:
            out[event.job_id].add([event.token_id], now)
        for fin in step.finished:
            out[fin.job_id].stop_type = str(fin.event.reason)
    return [out[r.job_id] for r in reqs]


# ---- measurements ---------------------------------------------------------------------


def metrics(streams: Sequence[Stream]) -> dict[str, float]:
    """Generated tokens / wall, TTFT, and (one stream) the generation rate."""
    out = burst_metrics(streams)
    if len(streams) == 1:
        s = streams[0]
        out["decode_tok_s"] = (len(s.tokens) - 1) / (s.last - s.first)
    return out


def check_streams(system: str, jobs: Sequence[Job], streams: Sequence[Stream]) -> list[str]:
    """Problems worth a note: wrong token counts, prompts the server counted differently."""
    notes = []
    for i, (job, s) in enumerate(zip(jobs, streams, strict=True)):
        if len(s.tokens) != job.max_new:
            notes.append(f"{system}: job {i} got {len(s.tokens)} tokens, asked {job.max_new}")
        if s.prompt_tokens != len(job.prompt_ids):
            notes.append(
                f"{system}: job {i} prompt evaluated as {s.prompt_tokens} tokens, "
                f"sent {len(job.prompt_ids)}"
            )
    return notes


@dataclass
class Workloads:
    one: list[Job]
    multi: list[Job]
    mixed: list[Job]
    warm: list[Job]

    @classmethod
    def make(cls, s: Settings, vocab: int) -> Workloads:
        return cls(
            one=uniform_jobs(1, s.one[0], s.one[1], vocab, seed=1),
            multi=uniform_jobs(s.multi[0], s.multi[1], s.multi[2], vocab, seed=1),
            mixed=mixed_jobs(s.mixed_n, s.mixed_prompt, s.mixed_new, vocab, seed=2),
            warm=uniform_jobs(4, 8, 8, vocab, seed=99),
        )

    def scenarios(self) -> dict[str, list[Job]]:
        return {"one": self.one, "multi": self.multi, "mixed": self.mixed}


class Bench:
    """Holds the loaded models and servers, and every round's measurements."""

    def __init__(
        self,
        s: Settings,
        threads: int,
        ours: list[str],
        theirs: list[str],
        bin_dir: Path | None,
        log: Callable[[str], None],
    ) -> None:
        self.s = s
        self.threads = threads
        self.log = log
        self.bin_dir = bin_dir
        self.notes: list[str] = []
        self.ours: dict[str, LoadedModel] = {}
        self.load_s: dict[str, float] = {}
        for name in ours:
            start = time.perf_counter()
            self.ours[name] = OURS[name].load()
            self.load_s[name] = time.perf_counter() - start
            log(f"tokenfleet {name}: loaded in {self.load_s[name]:.1f} s")
        any_model = next(iter(self.ours.values()))
        self.vocab = any_model.config.vocab_size
        self.work = Workloads.make(s, self.vocab)
        self.files: dict[str, Path] = {}
        self.servers: dict[tuple[str, str], Server] = {}
        self.has_bb = bin_dir is not None and (bin_dir / "llama-batched-bench").is_file()
        if bin_dir is not None:
            if not self.has_bb:
                self.note(f"no llama-batched-bench in {bin_dir}: its rows are skipped")
            for name in theirs:
                try:
                    self.files[name] = gguf_file(name, bin_dir, log)
                except (OSError, RuntimeError) as exc:
                    self.note(f"llama.cpp {name} skipped: {exc}")
        # scenario -> system -> one record per round
        self.results: dict[str, dict[str, list[dict[str, Any]]]] = {
            k: {} for k in self.work.scenarios()
        }
        self.rounds: list[dict[str, Any]] = []

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)
            self.log(f"note: {message}")

    # -- llama.cpp servers, one per (file, scenario), started once --

    def server(self, name: str, scenario: str) -> Server:
        key = (name, scenario)
        if key not in self.servers:
            assert self.bin_dir is not None
            jobs = self.work.scenarios()[scenario]
            slot_ctx = round_up(max(len(j.prompt_ids) + j.max_new for j in jobs) + 16, 256)
            log = CACHE / "logs" / f"llama-server-{name}-{scenario}.log"
            srv = Server(self.bin_dir, self.files[name], self.threads, len(jobs), slot_ctx, log)
            self.servers[key] = srv
            # warm-up: a burst as wide as the scenario, then the scenario itself
            warm = [self.work.warm[i % len(self.work.warm)] for i in range(len(jobs))]
            srv.burst(warm)
            srv.burst(jobs)
        return self.servers[key]

    def servers_cpu_s(self) -> float:
        return sum(s.cpu_seconds() for s in self.servers.values())

    def close(self) -> None:
        for srv in self.servers.values():
            srv.close()
        self.servers.clear()

    # -- rounds --

    def record(self, scenario: str, system: str, values: dict[str, Any], rnd: int) -> None:
        self.results[scenario].setdefault(system, []).append({"round": rnd, **values})

    def warm_up(self) -> None:
        for name, loaded in self.ours.items():
            for jobs in (self.work.warm, self.work.warm[:1], *self.work.scenarios().values()):
                engine_burst(loaded, jobs)
            self.log(f"tokenfleet {name}: warmed up")
        for name in list(self.files):
            try:
                for scenario in self.work.scenarios():
                    self.server(name, scenario)
            except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError
                self.note(f"llama.cpp {name} skipped: its llama-server failed: {exc}")
                for key in [k for k in self.servers if k[0] == name]:
                    self.servers.pop(key).close()
                del self.files[name]
                continue
            self.log(f"llama-server {name}: {len(self.work.scenarios())} servers up, warmed up")

    def run_ours(self, rnd: int) -> None:
        cpu_before = self.servers_cpu_s()
        for name, loaded in self.ours.items():
            for scenario, jobs in self.work.scenarios().items():
                streams = engine_burst(loaded, jobs)
                for msg in check_streams(f"tokenfleet {name}", jobs, streams):
                    self.note(msg)
                self.record(scenario, f"tokenfleet {name}", metrics(streams), rnd)
        idle = self.servers_cpu_s() - cpu_before
        if idle > 0.5:
            self.note(f"round {rnd}: the idle llama-servers used {idle:.1f} CPU s during ours")

    def run_theirs(self, rnd: int) -> None:
        assert self.bin_dir is not None
        for name, path in self.files.items():
            label = THEIRS[name].label(name)
            for scenario, jobs in self.work.scenarios().items():
                srv = self.server(name, scenario)
                streams = srv.burst(jobs)
                for msg in check_streams(f"llama-server {label}", jobs, streams):
                    self.note(msg)
                self.record(scenario, f"llama-server {label}", metrics(streams), rnd)
            if not self.has_bb:
                continue
            p, n = self.s.one
            row = batched_bench(self.bin_dir, path, self.threads, p, n, 1)
            self.record(
                "one",
                f"llama-batched-bench {label}",
                {"tok_s": n / row["t"], "decode_tok_s": row["speed_tg"], **row},
                rnd,
            )
            b, p, n = self.s.multi
            row = batched_bench(self.bin_dir, path, self.threads, p, n, b)
            self.record(
                "multi",
                f"llama-batched-bench {label}",
                {"tok_s": b * n / row["t"], "decode_tok_s": row["speed_tg"], **row},
                rnd,
            )

    def run_rounds(self, rounds: int) -> None:
        sides: list[tuple[str, Callable[[int], None]]] = [("tokenfleet", self.run_ours)]
        if self.files:
            sides.append(("llama.cpp", self.run_theirs))
        for rnd in range(rounds):
            order = abba(sides, rnd)
            at_start = load_now()
            start = time.perf_counter()
            for _, run in order:
                run(rnd)
            entry: dict[str, Any] = {
                "round": rnd,
                "order": [name for name, _ in order],
                "seconds": time.perf_counter() - start,
                "load_start": at_start,
                "load_end": load_now(),
            }
            self.rounds.append(entry)
            self.log(
                f"round {rnd + 1}/{rounds} ({' then '.join(entry['order'])}) "
                f"{entry['seconds']:.0f} s, load {at_start['loadavg'][0]:.2f} -> "
                f"{loadavg()[0]:.2f}"
            )

    # -- quality --

    def quality(self) -> dict[str, Any]:
        """Greedy tokens on fixed text prompts, each variant against tokenfleet fp32."""
        first = next(iter(self.ours.values()))
        assert first.tokenizer is not None
        prompts = QUALITY_PROMPTS[: self.s.quality_prompts]
        jobs = [Job(first.tokenizer.encode(p), self.s.quality_new) for p in prompts]
        tokens: dict[str, list[list[int]]] = {}
        eog: list[int] = []
        for name, loaded in self.ours.items():
            tokens[f"tokenfleet {name}"] = [s.tokens for s in engine_burst(loaded, jobs)]
        if "fp32" not in self.ours:
            reference_loaded = OURS["fp32"].load()
            tokens["tokenfleet fp32"] = [s.tokens for s in engine_burst(reference_loaded, jobs)]
        for name in self.files:
            srv = self.server(name, "one")  # one slot: the prompts one after another
            got = [srv.stream(j.prompt_ids, j.max_new, time.perf_counter()) for j in jobs]
            for msg in check_streams(f"llama-server {name} (quality)", jobs, got):
                self.note(msg)
            eog = eog or got[0].eog
            tokens[f"llama.cpp {THEIRS[name].label(name)}"] = [s.tokens for s in got]
        reference = tokens["tokenfleet fp32"]
        ours_eos = sorted(TorchRunner(first).spec.eos_token_ids)
        emitted = sorted({t for seq in reference for t in seq if t in set(eog) | set(ours_eos)})
        if emitted:
            self.note(
                f"tokenfleet fp32 emitted end-of-generation ids {emitted} in the quality run: "
                "with ignore_eos tokenfleet keeps going after them, llama.cpp masks them "
                f"({eog}), so tokens after that point differ by construction"
            )
        systems = {}
        for system, seqs in tokens.items():
            same = [
                sum(a == b for a, b in zip(s, r, strict=True))
                for s, r in zip(seqs, reference, strict=True)
            ]
            systems[system] = {
                "identical_frac": sum(same) / sum(len(r) for r in reference),
                "identical_per_prompt": same,
                "first_divergence": [
                    first_divergence(s, r) for s, r in zip(seqs, reference, strict=True)
                ],
                "tokens": seqs,
            }
        return {
            "prompts": prompts,
            "prompt_ids": [j.prompt_ids for j in jobs],
            "new_tokens": self.s.quality_new,
            "llamacpp_masked_eog_ids": eog,
            "tokenfleet_eos_ids": ours_eos,
            "systems": systems,
        }

    def perplexity(self) -> dict[str, Any]:
        """Our variants and llama.cpp's files on the same text, windows and scoring."""
        body = text_body()
        CACHE.mkdir(parents=True, exist_ok=True)
        text_file = CACHE / TEXT.name  # header stripped: what llama-perplexity reads
        text_file.write_text(body)
        first = next(iter(self.ours.values()))
        assert first.tokenizer is not None
        ours_ids = first.tokenizer.encode(body)
        add_bos, bos = gguf_add_bos()
        ids, source = ours_ids, "tokenfleet's tokenizer"
        out: dict[str, Any] = {
            "text": str(TEXT.relative_to(REPO)),
            "text_chars": len(body),
            "tokens_tokenfleet": len(ours_ids),
            "add_bos": add_bos,
            "ctx": self.s.ppl_ctx,
            "chunks": self.s.ppl_chunks,
        }
        if self.files:
            theirs_ids = self.server(next(iter(self.files)), "one").tokenize(body)
            out["tokens_llamacpp"] = len(theirs_ids)
            out["same_tokens"] = theirs_ids == ours_ids
            if theirs_ids != ours_ids:
                at = first_divergence(theirs_ids, ours_ids)
                self.note(
                    f"the perplexity text tokenizes differently (first difference at token "
                    f"{at}): tokenfleet scores llama.cpp's token ids"
                )
                ids, source = theirs_ids, "llama.cpp's /tokenize"
        out["token_ids_from"] = source
        systems: dict[str, Any] = {}
        for name, loaded in self.ours.items():
            systems[f"tokenfleet {name}"] = our_perplexity(
                loaded, list(ids), self.s.ppl_ctx, self.s.ppl_chunks, bos if add_bos else None
            )
            self.log(f"perplexity tokenfleet {name}: {systems[f'tokenfleet {name}']['ppl']:.4f}")
        have_tool = self.bin_dir is not None and (self.bin_dir / "llama-perplexity").is_file()
        if self.files and not have_tool:
            self.note("no llama-perplexity: rerun bench/build_llamacpp.sh; llama.cpp PPL skipped")
        for name, path in self.files.items() if have_tool else ():
            assert self.bin_dir is not None
            label = f"llama.cpp {THEIRS[name].label(name)}"
            systems[label] = llama_perplexity(
                self.bin_dir, path, text_file, self.threads, self.s.ppl_ctx, self.s.ppl_chunks
            )
            self.log(f"perplexity {label}: {systems[label]['ppl']:.4f}")
            ours_windows = next(iter(systems.values()))["windows"]
            if systems[label]["windows"] != ours_windows:
                self.note(
                    f"{label} perplexity is over {systems[label]['windows']} windows, "
                    f"tokenfleet's over {ours_windows}"
                )
        out["systems"] = systems
        return out


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---- summaries, tables, plot ----------------------------------------------------------


def summarize(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """scenario -> system -> metric -> min / median / max over the rounds."""
    out: dict[str, Any] = {}
    for scenario, systems in results.items():
        out[scenario] = {}
        for system, records in systems.items():
            keys = [k for k, v in records[0].items() if k != "round" and isinstance(v, float)]
            out[scenario][system] = spreads(records, keys)
    return out


def median(summary: dict[str, Any], scenario: str, system: str, metric: str) -> float:
    try:
        return float(summary[scenario][system][metric]["median"])
    except KeyError:
        return math.nan


def ratios(summary: dict[str, Any], ours: list[str], theirs: list[str]) -> list[dict[str, Any]]:
    """Each of our variants over its llama.cpp counterpart (medians): > 1 is ours faster
    (TTFT: theirs / ours, > 1 is ours sooner)."""
    rows = []
    for name in ours:
        versus = OURS[name].versus
        if versus not in theirs:
            continue
        me, label = f"tokenfleet {name}", THEIRS[versus].label(versus)
        srv, bb = f"llama-server {label}", f"llama-batched-bench {label}"

        def r(scenario: str, other: str, metric: str, inverse: bool = False, me: str = me) -> float:
            a, b = median(summary, scenario, me, metric), median(summary, scenario, other, metric)
            return b / a if inverse else a / b

        rows.append(
            {
                "ours": name,
                "versus": label,
                "one_decode_vs_server": r("one", srv, "decode_tok_s"),
                "one_decode_vs_batched_bench": r("one", bb, "decode_tok_s"),
                "multi_vs_server": r("multi", srv, "tok_s"),
                "multi_vs_batched_bench": r("multi", bb, "tok_s"),
                "mixed_vs_server": r("mixed", srv, "tok_s"),
                "mixed_ttft_p50_server_over_ours": r("mixed", srv, "ttft_p50_s", inverse=True),
            }
        )
    return rows


# ---- main -----------------------------------------------------------------------------


def variant_names(arg: str, table: dict[str, Any], what: str) -> list[str]:
    got = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in got if n not in table]
    if unknown:
        sys.exit(f"unknown {what} variant(s) {unknown}: choose from {', '.join(table)}")
    return got


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="tiny lengths (< 2 min)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2, help="torch threads and llama -t/-tb")
    p.add_argument("--ours", default="fp32,bf16", help=f"of {', '.join(OURS)}")
    p.add_argument("--theirs", default="q4_1,q8_0,f32", help=f"of {', '.join(THEIRS)}")
    p.add_argument("--llamacpp-bin", help="llama.cpp bin dir (default: build_llamacpp.sh)")
    outputs(p, "vs_llamacpp")
    args = p.parse_args()
    ours = variant_names(args.ours, OURS, "--ours")
    theirs = variant_names(args.theirs, THEIRS, "--theirs")
    if not ours:
        sys.exit("--ours needs at least one variant")

    torch.set_num_threads(args.threads)
    settings = Settings.quick() if args.quick else Settings.full()
    run = Run()
    log = run.log
    notes: list[str] = []
    bin_dir: Path | None = None
    version = None
    if not theirs:
        notes.append("llama.cpp side not run (--theirs is empty)")
    else:
        bin_dir, why = find_llamacpp(args.llamacpp_bin, log)
        if bin_dir is None:
            notes.append(f"llama.cpp side skipped: {why}")
            log(f"SKIPPING llama.cpp: {why}")
        else:
            version = llamacpp_version(bin_dir)
            log(f"llama.cpp {version} in {bin_dir}")
    bench = Bench(settings, args.threads, ours, theirs if bin_dir else [], bin_dir, log)
    bench.notes[:0] = notes
    try:
        bench.warm_up()
        bench.run_rounds(args.rounds)
        log("quality: greedy tokens")
        quality = bench.quality()
        log("perplexity")
        ppl = bench.perplexity()
    finally:
        bench.close()
    summary = summarize(bench.results)
    report = run.report(
        quick=args.quick,
        threads=args.threads,
        settings=asdict(settings),
        tokenfleet={
            name: {
                "about": OURS[name].about,
                "versus": OURS[name].versus,
                "load_s": bench.load_s[name],
                "dtype": str(bench.ours[name].dtype),
                "weight_bytes": bench.ours[name].weight_bytes,
                "source_quant": bench.ours[name].source_quant,
            }
            for name in ours
        },
        llamacpp={
            "bin": str(bin_dir) if bin_dir else None,
            "version": version,
            "files": {
                n: {"about": THEIRS[n].about, "path": str(f), "bytes": f.stat().st_size}
                for n, f in bench.files.items()
            },
        },
        rounds=bench.rounds,
        measurements=bench.results,
        summary=summary,
        ratios=ratios(summary, ours, list(bench.files)),
        quality=quality,
        perplexity=ppl,
        notes=bench.notes,
    )
    markdown = "\n".join(render(report, markdown_table)) + "\n"
    table = "\n".join(render(report, text_table))
    run.finish(args, report, markdown, partial(plot, report), table=table)


if __name__ == "__main__":
    main()
