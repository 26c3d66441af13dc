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
scored the way `llama-perplexity -c 512` scores them (see `our_perplexity`), for our
variants and for llama.cpp's files through llama-perplexity itself.

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

import argparse
import http.client
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import Job, mixed_jobs, uniform_jobs
from report import (
    load_now,
    loadavg,
    machine_info,
    mark_end,
    markdown_table,
    num,
    pct,
    progress,
    pyplot,
    save_figure,
    spread,
    text_table,
    write_report,
    wrote,
)

from tokenfleet.model import KVPool, LlamaModel, LoadedModel, SeqInput, TorchRunner, load_model
from tokenfleet.model.smollm2 import PRESET, require_smollm2_gguf
from tokenfleet.protocol import GenerationRequest
from tokenfleet.worker.engine import Engine, EngineConfig

REPO = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "tokenfleet" / "vs_llamacpp"
TEXT = REPO / "bench" / "data" / "declaration_gettysburg.txt"
HEADER_END = "# ----\n"  # the data file's header ends with this line
MiB = 1024 * 1024

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
        return cls((32, 256), (8, 32, 128), 16, (8, 64), (16, 96), 4, 64, 512, None)

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


# ---- llama.cpp: binaries, files, server ----------------------------------------------


def find_llamacpp(given: str | None, log: Callable[[str], None]) -> tuple[Path | None, str]:
    """The bin dir (--llamacpp-bin, else bench/build_llamacpp.sh's last line), or None and
    why not."""
    if given:
        folder = Path(given)
    else:
        script = REPO / "bench" / "build_llamacpp.sh"
        log(f"llama.cpp: {script.name} (quick when built; ~10 min the first time)")
        try:
            proc = subprocess.run(
                ["nice", "-n", "19", "bash", str(script)], capture_output=True, text=True
            )
        except OSError as exc:
            return None, f"could not run {script}: {exc}"
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"{script.name} failed (rc {proc.returncode}): {' | '.join(tail)}"
        folder = Path(lines[-1])
    if not (folder / "llama-server").is_file():
        return None, f"no llama-server in {folder}"
    return folder, ""


def llamacpp_version(bin_dir: Path) -> str:
    proc = subprocess.run(
        [str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True
    )
    found = re.search(r"version: .*", proc.stdout + proc.stderr)
    return found.group(0) if found else "unknown"


def gguf_file(name: str, bin_dir: Path, log: Callable[[str], None]) -> Path:
    """The GGUF file of a THEIRS entry, made once with llama-quantize and cached."""
    source = require_smollm2_gguf()
    quant = THEIRS[name].quant
    if quant is None:
        return source
    out = CACHE / f"{source.stem.replace('.Q4_1', '')}.{quant}.from-Q4_1.gguf"
    if out.is_file():
        return out
    tool = bin_dir / "llama-quantize"
    if not tool.is_file():
        raise FileNotFoundError(f"no llama-quantize in {bin_dir}: rerun bench/build_llamacpp.sh")
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    log(f"llama-quantize {source.name} -> {out.name}")
    proc = subprocess.run(
        ["nice", "-n", "19", str(tool), "--allow-requantize", str(source), str(partial), quant],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama-quantize {quant} failed: {proc.stderr.strip()[-400:]}")
    partial.rename(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Stream:
    """One request's timeline (seconds since the burst's t0) and what came back."""

    first: float = math.nan  # first token
    last: float = math.nan  # last token
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = -1  # what the server says it evaluated
    cached_tokens: int = 0  # prompt tokens llama-server took from its cache (timings.cache_n)
    stop_type: str = ""
    eog: list[int] = field(default_factory=list)  # tokens ignore_eos masked (server's view)


class Server:
    """One llama-server process: `slots` parallel slots of `slot_ctx` tokens each."""

    def __init__(
        self,
        bin_dir: Path,
        model: Path,
        threads: int,
        slots: int,
        slot_ctx: int,
        log: Path,
        *,
        prompt_cache: bool = False,
    ) -> None:
        self.port = free_port()
        self.prompt_cache = prompt_cache
        self.slots = slots
        self.log_path = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        self.args = [
            str(bin_dir / "llama-server"),
            *("-m", str(model), "-t", str(threads), "-tb", str(threads)),
            *("-np", str(slots), "-c", str(slots * slot_ctx)),
            *("--host", "127.0.0.1", "--port", str(self.port), "--no-webui"),
        ]
        if not prompt_cache:  # every request here is a new prompt: no cache in RAM either
            self.args += ["--cache-ram", "0"]
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log_tail()}")
            try:
                status, _ = self._request("GET", "/health", None, timeout=2.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"llama-server not ready in {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 5) -> str:
        self._log.flush()
        return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-n:])

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout: float = 600.0
    ) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
        finally:
            conn.close()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        status, reply = self._request("POST", path, body)
        if status != 200:
            raise RuntimeError(f"llama-server {path}: HTTP {status}: {reply}")
        return reply

    def tokenize(self, text: str) -> list[int]:
        """How llama.cpp tokenizes `text` (add_special: BOS when the vocab adds one)."""
        return [
            int(t) for t in self.post("/tokenize", {"content": text, "add_special": True})["tokens"]
        ]

    def stream(self, prompt: list[int], new: int, t0: float) -> Stream:
        """One streamed greedy /completion of exactly `new` tokens from token ids."""
        out = Stream()
        body = completion_body(prompt, new) | {"stream": True, "cache_prompt": self.prompt_cache}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", "/completion", json.dumps(body))
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"llama-server /completion: HTTP {resp.status}: {resp.read()!r}")
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("tokens"):
                    now = time.perf_counter() - t0
                    if not out.tokens:
                        out.first = now
                    out.last = now
                    out.tokens.extend(chunk["tokens"])
                out.prompt_tokens = int(chunk.get("tokens_evaluated", out.prompt_tokens))
                if "timings" in chunk:  # the final chunk: how much of the prompt was cached
                    out.cached_tokens = int(chunk["timings"].get("cache_n", out.cached_tokens))
                if chunk.get("stop"):
                    out.stop_type = str(chunk.get("stop_type", ""))
                    settings = chunk.get("generation_settings", {})
                    out.eog = [
                        b["token"] for b in settings.get("logit_bias", []) if b.get("bias") is None
                    ]  # -inf, sent as null
                    break
        finally:
            conn.close()
        return out

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def completion_body(prompt: list[int], new: int) -> dict[str, Any]:
    return {
        "prompt": prompt,  # token ids: the server adds no BOS to them
        "n_predict": new,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
        "return_tokens": True,
    }


def server_burst(server: Server, jobs: Sequence[Job]) -> list[Stream]:
    """All `jobs` sent at once, one thread each; times from the common t0."""
    results: list[Stream | BaseException | None] = [None] * len(jobs)
    go = threading.Barrier(len(jobs) + 1)
    t0_box: list[float] = []

    def one(i: int, job: Job) -> None:
        go.wait()
        try:
            results[i] = server.stream(job.prompt_ids, job.max_new, t0_box[0])
        except BaseException as exc:  # reported below, in the caller's thread
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    t0_box.append(time.perf_counter())
    go.wait()
    for t in threads:
        t.join()
    streams: list[Stream] = []
    for r in results:
        if not isinstance(r, Stream):
            raise RuntimeError(f"llama-server request failed: {r!r}")
        streams.append(r)
    return streams


def batched_bench(
    bin_dir: Path, model: Path, threads: int, prompt: int, new: int, streams: int
) -> dict[str, float]:
    """One `llama-batched-bench` shape: its row, from --output-format jsonl (else the
    markdown table)."""
    ctx = streams * round_up(prompt + new, 256)
    args = [
        str(bin_dir / "llama-batched-bench"),
        *("-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(ctx)),
        *("-npp", str(prompt), "-ntg", str(new), "-npl", str(streams)),
        *("--output-format", "jsonl"),
    ]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed: {proc.stderr.strip()[-400:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"pl"' in line:
            row = json.loads(line)
            return {k: float(row[k]) for k in ("t_pp", "speed_pp", "t_tg", "speed_tg", "t")}
    return parse_batched_table(proc.stdout)


def parse_batched_table(text: str) -> dict[str, float]:
    """The first data row of batched-bench's markdown table
    (| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |)."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            t_pp, s_pp, t_tg, s_tg, t = (float(cells[i]) for i in (4, 5, 6, 7, 8))
            return {"t_pp": t_pp, "speed_pp": s_pp, "t_tg": t_tg, "speed_tg": s_tg, "t": t}
    raise RuntimeError(f"no result row in llama-batched-bench output: {text[-400:]!r}")


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def llama_perplexity(
    bin_dir: Path, model: Path, text_file: Path, threads: int, ctx: int, chunks: int | None
) -> dict[str, Any]:
    """`llama-perplexity -f text -c ctx`: its final estimate (+/-) and per-window values."""
    args = [
        str(bin_dir / "llama-perplexity"),
        *("-m", str(model), "-f", str(text_file), "-c", str(ctx)),
        *("-t", str(threads), "-tb", str(threads)),
    ]
    if chunks is not None:
        args += ["--chunks", str(chunks)]
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    if proc.returncode != 0 or final is None:
        raise RuntimeError(f"llama-perplexity failed (rc {proc.returncode}): {out.strip()[-400:]}")
    windows = re.search(r"over (\d+) chunks, n_ctx=(\d+)", out)
    return {
        "ppl": float(final.group(1)),
        "ppl_err": float(final.group(2)),
        "windows": int(windows.group(1)) if windows else None,
        "ctx": int(windows.group(2)) if windows else ctx,
        "running_ppl": [float(x) for x in re.findall(r"\[\d+\]([0-9.]+)", out)],
        "seconds": seconds,
    }


# ---- tokenfleet side ------------------------------------------------------------------


def engine_config(loaded: LoadedModel, jobs: Sequence[Job]) -> EngineConfig:
    """Room for every job at once (K and V in the model's dtype, a block of slack each);
    the other knobs are the engine's defaults."""
    cfg = loaded.config
    dtype_bytes = torch.empty((), dtype=loaded.dtype).element_size()
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    tokens = sum(len(j.prompt_ids) + j.max_new + 16 for j in jobs)
    return EngineConfig(
        kv_budget_bytes=max(16 * MiB, 2 * per_token * tokens),
        max_batch_size=len(jobs),
        max_active=len(jobs),
        max_waiting=len(jobs),
    )


def engine_burst(loaded: LoadedModel, jobs: Sequence[Job]) -> list[Stream]:
    """All `jobs` submitted at once, stepped until done; a token's time is the end of the
    step that produced it (when a caller of `step()` gets it)."""
    engine = Engine(TorchRunner(loaded), engine_config(loaded, jobs))
    reqs = [
        GenerationRequest(
            job_id=f"j{i}", prompt_ids=j.prompt_ids, max_new_tokens=j.max_new, ignore_eos=True
        )
        for i, j in enumerate(jobs)
    ]
    out = {r.job_id: Stream(prompt_tokens=len(r.prompt_ids or [])) for r in reqs}
    t0 = time.perf_counter()
    for req in reqs:
        if not engine.submit(req).accepted:
            raise RuntimeError(f"engine did not accept {req.job_id}")
    while engine.has_work:
        step = engine.step()
        now = time.perf_counter() - t0
        for event in step.tokens:
            s = out[event.job_id]
            if not s.tokens:
                s.first = now
            s.last = now
            s.tokens.append(event.token_id)
        for fin in step.finished:
            out[fin.job_id].stop_type = str(fin.event.reason)
    return [out[r.job_id] for r in reqs]


def our_perplexity(
    loaded: LoadedModel, tokens: list[int], ctx: int, chunks: int | None, bos: int | None
) -> dict[str, Any]:
    """Perplexity as llama-perplexity computes it (tools/perplexity/perplexity.cpp):
    windows tokens[i*ctx : (i+1)*ctx] for i < len(tokens) // ctx (or `chunks`), each on an
    empty cache, its first token replaced by BOS when the vocab adds one (`bos`); only the
    second half is scored: the logits at positions ctx/2 .. ctx-2 against the next tokens,
    ctx/2 - 1 per window; PPL = exp(mean NLL), +/- as llama.cpp's. The logits come from
    `window_logits`."""
    model = loaded.model
    block = 16
    blocks = -(-ctx // block)
    pool = model.new_kv_pool(blocks, block)
    table = list(range(blocks))
    first = ctx // 2
    n_windows = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    if n_windows < 1:
        raise ValueError(f"the text has {len(tokens)} tokens, less than one window of {ctx}")
    nll, nll2, count = 0.0, 0.0, 0
    running: list[float] = []
    methods: list[str] = []
    checks: list[float] = []
    start = time.perf_counter()
    for w in range(n_windows):
        window = tokens[w * ctx : (w + 1) * ctx]
        if bos is not None:
            window[0] = bos
        logits, method, check = window_logits(model, pool, table, window, first)
        methods.append(method)
        checks.append(check)
        logp = torch.log_softmax(logits.double(), dim=-1)
        target = torch.tensor(window[first + 1 :])
        picked = -logp[torch.arange(len(target)), target]
        nll += float(picked.sum())
        nll2 += float((picked * picked).sum())
        count += len(target)
        running.append(math.exp(nll / count))
    mean, mean2 = nll / count, nll2 / count
    ppl = math.exp(mean)
    err = math.sqrt(max(mean2 - mean * mean, 0.0) / (count - 1)) * ppl
    return {
        "ppl": ppl,
        "ppl_err": err,
        "windows": n_windows,
        "ctx": ctx,
        "scored_tokens": count,
        "running_ppl": running,
        "seconds": time.perf_counter() - start,
        "logits_from": sorted(set(methods)),
        "check_max_abs_logit_diff": max(checks),
    }


def window_logits(
    model: LlamaModel, pool: KVPool, table: list[int], window: list[int], first: int
) -> tuple[torch.Tensor, str, float]:
    """float32 logits at positions first .. len(window) - 2 of one window on an empty
    cache, how they were got, and the check's max |difference|.

    `LlamaModel.forward` returns each sequence's LAST logits only. So: one prefill of
    window[:-1] (the cheapest forward over the window), with a hook on the last decoder
    layer keeping the hidden states of every row, and the final norm + LM head applied to
    the scored rows ("hidden-states hook"). Valid when its last row equals what forward
    returned (checked every window). When it does not (a compiled path that bypasses the
    layer modules, say), the fallback uses the public API alone ("decode rows"): ONE more
    forward with every scored position as a one-token row sharing the window's block table
    (row p at start_pos p). A forward writes every row's K/V into the pool before any
    attention reads it, so row p attends to positions 0..p exactly: teacher forcing, as a
    decode tick computes it; ~2x the prefill's time (each row gathers its own K/V)."""
    n = len(window) - 1
    captured: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            captured.append(output)

    handle = model.layers[-1].register_forward_hook(keep)
    try:
        final = model.forward(torch.tensor(window[:n]), [SeqInput(table, 0, n)], pool)[0]
    finally:
        handle.remove()
    # numerical noise only (bf16 rows computed in another order differ by ~1%); a wrong
    # hidden state (another layer's, a missed norm) is off by the logits' own size
    rel = 2e-3 if model.dtype == torch.float32 else 5e-2
    tolerance = rel * max(1.0, float(final.abs().max()))
    if len(captured) == 1 and captured[0].shape[0] == n:
        with torch.inference_mode():
            logits = model.lm_head(model.norm(captured[0][first:])).float()
        check = float((logits[-1] - final).abs().max())
        if check <= tolerance:
            return logits, "hidden-states hook", check
    rows = range(first, n)
    logits = model.forward(
        torch.tensor(window[first:n]), [SeqInput(table, p, 1) for p in rows], pool
    )
    check = float((logits[-1] - final).abs().max())
    if check > tolerance:
        raise RuntimeError(f"decode-row logits differ from the prefill's by {check:.3g}")
    return logits, "decode rows", check


# ---- measurements ---------------------------------------------------------------------


def metrics(streams: Sequence[Stream]) -> dict[str, float]:
    """Generated tokens / wall, TTFT, and (one stream) the generation rate."""
    wall = max(s.last for s in streams)
    generated = sum(len(s.tokens) for s in streams)
    firsts = [s.first for s in streams]
    out = {
        "tok_s": generated / wall,
        "wall_s": wall,
        "ttft_p50_s": pct(firsts, 50),
        "ttft_p99_s": pct(firsts, 99),
    }
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
            server_burst(srv, warm)
            server_burst(srv, jobs)
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
                streams = server_burst(srv, jobs)
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
            order = sides if rnd % 2 == 0 else sides[::-1]  # ABBA over the rounds
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
        body = TEXT.read_text().split(HEADER_END, 1)[1]
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


def gguf_add_bos() -> tuple[bool, int | None]:
    """Whether llama.cpp prepends BOS for this vocab (tokenizer.ggml.add_bos_token, absent:
    False, as for SmolLM2's gpt2-style vocab), and the BOS id."""
    from tokenfleet.model.gguf import open_gguf

    reader = open_gguf(require_smollm2_gguf())

    def value(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    bos = value("tokenizer.ggml.bos_token_id")
    return bool(value("tokenizer.ggml.add_bos_token")), None if bos is None else int(bos)


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
            out[scenario][system] = {k: spread([r[k] for r in records]) for k in keys}
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


def fmt_spread(stats: dict[str, Any] | None, fmt: str = ".1f", scale: float = 1.0) -> list[str]:
    if stats is None:
        return ["n/a"] * 3
    return [num(stats[k] * scale, fmt) for k in ("median", "min", "max")]


def speed_tables(
    summary: dict[str, Any], s: Settings
) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) per scenario."""
    b, p, n = s.multi
    titles = {
        "one": f"one stream: {s.one[0]} prompt + {s.one[1]} new tokens; generation tok/s "
        "(first to last token) and end to end",
        "multi": f"{b} streams: {b} x ({p} prompt + {n} new) at once; aggregate generated "
        "tok/s (prefill included)",
        "mixed": f"mixed: {s.mixed_n} jobs at once, prompts {s.mixed_prompt[0]}-"
        f"{s.mixed_prompt[1]}, new {s.mixed_new[0]}-{s.mixed_new[1]}; useful tok/s, TTFT",
    }
    tables = []
    for scenario, systems in summary.items():
        rows = []
        if scenario == "one":
            header = ["system", "gen tok/s med", "min", "max", "e2e tok/s med"]
            for system, m in systems.items():
                rows.append(
                    [system, *fmt_spread(m.get("decode_tok_s")), num(m["tok_s"]["median"], ".1f")]
                )
        elif scenario == "multi":
            header = ["system", "tok/s med", "min", "max", "decode-only tok/s med"]
            for system, m in systems.items():
                dec = m.get("decode_tok_s")
                rows.append(
                    [system, *fmt_spread(m["tok_s"]), num(dec["median"], ".1f") if dec else ""]
                )
        else:
            header = ["system", "tok/s med", "min", "max", "TTFT p50 ms", "TTFT p99 ms"]
            for system, m in systems.items():
                rows.append(
                    [
                        system,
                        *fmt_spread(m["tok_s"]),
                        num(1000 * m["ttft_p50_s"]["median"], ".0f"),
                        num(1000 * m["ttft_p99_s"]["median"], ".0f"),
                    ]
                )
        tables.append((titles[scenario], header, rows))
    return tables


def ratio_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = [
        "ours",
        "vs llama.cpp",
        "one: gen (server)",
        "one: gen (bb)",
        "multi (server)",
        "multi (bb)",
        "mixed tok/s",
        "mixed TTFT p50",
    ]
    body = [
        [
            r["ours"],
            r["versus"],
            *(
                num(r[k], ".2f") + "x"
                for k in (
                    "one_decode_vs_server",
                    "one_decode_vs_batched_bench",
                    "multi_vs_server",
                    "multi_vs_batched_bench",
                    "mixed_vs_server",
                    "mixed_ttft_p50_server_over_ours",
                )
            ),
        ]
        for r in rows
    ]
    return header, body


def quality_table(
    quality: dict[str, Any], ppl: dict[str, Any]
) -> tuple[list[str], list[list[str]]]:
    header = ["system", "greedy tokens = fp32", "first divergence", "PPL", "+/-", "windows"]
    names = list(dict.fromkeys([*quality["systems"], *ppl["systems"]]))
    rows = []
    for name in names:
        q = quality["systems"].get(name)
        p = ppl["systems"].get(name)
        rows.append(
            [
                name,
                f"{q['identical_frac']:.1%}" if q else "",
                ",".join("-" if d is None else str(d) for d in q["first_divergence"]) if q else "",
                num(p["ppl"], ".4f") if p else "",
                num(p["ppl_err"], ".4f") if p else "",
                str(p["windows"]) if p else "",
            ]
        )
    return header, rows


def round_lines(rounds: list[dict[str, Any]]) -> list[str]:
    return [
        f"round {r['round'] + 1}: {' then '.join(r['order'])}, {r['seconds']:.0f} s, "
        f"load avg {r['load_start']['loadavg'][0]:.2f} -> {r['load_end']['loadavg'][0]:.2f}, "
        f"CPU pressure avg60 {num(r['load_end']['cpu_pressure_avg60'], '.1f')}%"
        for r in rounds
    ]


def render(report: dict[str, Any], table: Callable[..., list[str]]) -> list[str]:
    lines: list[str] = []
    for title, header, rows in speed_tables(report["summary"], Settings(**report["settings"])):
        lines += ["", title, "", *table(header, rows)]
    if report["ratios"]:
        header, rows = ratio_table(report["ratios"])
        lines += [
            "",
            "ratios of medians (ours / llama.cpp; TTFT: llama.cpp / ours; > 1: ours "
            "better; bb = llama-batched-bench)",
            "",
            *table(header, rows),
        ]
    header, rows = quality_table(report["quality"], report["perplexity"])
    p = report["perplexity"]
    lines += [
        "",
        f"quality: greedy tokens vs tokenfleet fp32 ({report['quality']['new_tokens']} new x "
        f"{len(report['quality']['prompts'])} prompts); perplexity, ctx {p['ctx']}, second "
        f"half of each window scored, {p['tokens_tokenfleet']} text tokens",
        "",
        *table(header, rows),
        "",
        *round_lines(report["rounds"]),
    ]
    if report["notes"]:
        lines += ["", "notes:", *(f"- {n}" for n in report["notes"])]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    summary = report["summary"]
    panels = [
        ("one", "decode_tok_s", "one stream: generation tok/s"),
        ("multi", "tok_s", f"{report['settings']['multi'][0]} streams: aggregate tok/s"),
        ("mixed", "tok_s", "mixed: useful tok/s"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(20, 5.5))
    for ax, (scenario, metric, title) in zip(axes, panels, strict=False):
        systems = [k for k, v in summary.get(scenario, {}).items() if metric in v]
        med = [summary[scenario][k][metric]["median"] for k in systems]
        lo = [m - summary[scenario][k][metric]["min"] for k, m in zip(systems, med, strict=True)]
        hi = [summary[scenario][k][metric]["max"] - m for k, m in zip(systems, med, strict=True)]
        colors = [
            "C0" if k.startswith("tokenfleet") else "C1" if "server" in k else "C2" for k in systems
        ]
        bars = ax.barh(systems, med, xerr=[lo, hi], color=colors, capsize=3)
        ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=4)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("tokens/s (median, min-max over rounds)")
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    ax = axes[3]
    ppl = report["perplexity"]["systems"]
    names = list(ppl)
    values = [ppl[k]["ppl"] for k in names]
    bars = ax.barh(
        names, values, color=["C0" if k.startswith("tokenfleet") else "C1" for k in names]
    )
    ax.bar_label(bars, fmt="%.3f", fontsize=8, padding=4)
    if values:  # the variants differ by far less than PPL itself: zoom in
        least, most = min(values), max(values)
        pad = max(most - least, 0.01 * most)
        ax.set_xlim(least - pad, most + pad)
    err = max((ppl[k]["ppl_err"] for k in names), default=math.nan)
    ax.invert_yaxis()
    ax.set_title(
        f"perplexity, ctx {report['perplexity']['ctx']}, lower is better\n"
        f"(same tokens for all; the +/- over tokens: {err:.2f})",
        fontsize=9,
    )
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    load = [r["load_start"]["loadavg"][0] for r in report["rounds"]]
    fig.suptitle(
        f"tokenfleet vs llama.cpp, SmolLM2-135M-Instruct, {report['threads']} threads, "
        f"{len(report['rounds'])} rounds, load avg {min(load):.2f}-{max(load):.2f}"
        + (" (quick)" if report["quick"] else ""),
        fontsize=11,
    )
    save_figure(fig, path)


# ---- main -----------------------------------------------------------------------------


def variant_names(arg: str, table: dict[str, Any], what: str) -> list[str]:
    got = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in got if n not in table]
    if unknown:
        sys.exit(f"unknown {what} variant(s) {unknown}: choose from {', '.join(table)}")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny lengths (< 2 min)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama -t/-tb")
    parser.add_argument("--ours", default="fp32,bf16", help=f"of {', '.join(OURS)}")
    parser.add_argument("--theirs", default="q4_1,q8_0,f32", help=f"of {', '.join(THEIRS)}")
    parser.add_argument("--llamacpp-bin", help="llama.cpp bin dir (default: build_llamacpp.sh)")
    parser.add_argument("--out", default="bench/out/vs_llamacpp.json")
    parser.add_argument("--plot", default="docs/img/vs_llamacpp.png")
    args = parser.parse_args()
    ours = variant_names(args.ours, OURS, "--ours")
    theirs = variant_names(args.theirs, THEIRS, "--theirs")
    if not ours:
        sys.exit("--ours needs at least one variant")

    torch.set_num_threads(args.threads)
    settings = Settings.quick() if args.quick else Settings.full()
    log = progress()
    machine = machine_info()
    started = time.perf_counter()
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
    mark_end(machine)
    summary = summarize(bench.results)
    report: dict[str, Any] = {
        "machine": machine,
        "quick": args.quick,
        "threads": args.threads,
        "settings": asdict(settings),
        "wall_s": time.perf_counter() - started,
        "tokenfleet": {
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
        "llamacpp": {
            "bin": str(bin_dir) if bin_dir else None,
            "version": version,
            "files": {
                n: {"about": THEIRS[n].about, "path": str(p), "bytes": p.stat().st_size}
                for n, p in bench.files.items()
            },
        },
        "rounds": bench.rounds,
        "measurements": bench.results,
        "summary": summary,
        "ratios": ratios(summary, ours, list(bench.files)),
        "quality": quality,
        "perplexity": ppl,
        "notes": bench.notes,
    }
    print("\n".join(render(report, text_table)))
    out = write_report(Path(args.out), report, "\n".join(render(report, markdown_table)) + "\n")
    if args.plot:
        plot(report, Path(args.plot))
    print(wrote(out, args.plot, report["wall_s"]))


if __name__ == "__main__":
    main()
