"""llama.cpp as a baseline (bench/vs_llamacpp.py, prefix_cache.py): its binaries (from
bench/build_llamacpp.sh), GGUF files re-quantized from the shipped one, `llama-server`
processes fed token ids over HTTP and streamed, and the one-shot tools
`llama-batched-bench` and `llama-perplexity`."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import Job, Stream
from _rounds import wait_until

from tokenfleet.local import cpu_seconds, free_port
from tokenfleet.model.smollm2 import require_smollm2_gguf

BUILD_SCRIPT = Path(__file__).resolve().parent / "build_llamacpp.sh"
CACHE = Path.home() / ".cache" / "tokenfleet" / "vs_llamacpp"  # derived files, logs


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def run_tool(args: list[str], what: str) -> subprocess.CompletedProcess[str]:
    """A llama.cpp program run to its end; RuntimeError with its output's tail if it fails."""
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-400:]
        raise RuntimeError(f"{what} failed (rc {proc.returncode}): {tail}")
    return proc


def find_llamacpp(given: str | None, log: Callable[[str], None]) -> tuple[Path | None, str]:
    """The bin dir (--llamacpp-bin, else bench/build_llamacpp.sh's last line), or None and
    why not."""
    if given:
        folder = Path(given)
    else:
        log(f"llama.cpp: {BUILD_SCRIPT.name} (quick when built; ~10 min the first time)")
        try:
            proc = run_tool(["nice", "-n", "19", "bash", str(BUILD_SCRIPT)], BUILD_SCRIPT.name)
        except (OSError, RuntimeError) as exc:
            return None, str(exc)
        lines = proc.stdout.strip().splitlines()
        if not lines:
            return None, f"{BUILD_SCRIPT.name} printed no bin dir"
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


def derived_gguf(quant: str | None, bin_dir: Path, log: Callable[[str], None]) -> Path:
    """The shipped SmolLM2 Q4_1 file (`quant` None), or one llama-quantize made from it
    once (Q8_0, F32 ...) and cached under CACHE."""
    source = require_smollm2_gguf()
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
    args = ["nice", "-n", "19", str(tool), "--allow-requantize", str(source), str(partial)]
    run_tool([*args, quant], f"llama-quantize {quant}")
    partial.rename(out)
    return out


def completion_body(prompt: list[int], new: int) -> dict[str, Any]:
    return {
        "prompt": prompt,  # token ids: the server adds no BOS to them
        "n_predict": new,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
        "return_tokens": True,
    }


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
        if not wait_until(self._ready, 120.0, every_s=0.2):
            raise TimeoutError(f"llama-server not ready in 120 s: {self.log_tail()}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"llama-server exited: {self.log_tail()}")
        try:
            return self._request("GET", "/health", None, timeout=2.0)[0] == 200
        except OSError:
            return False

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

    def stream(self, prompt: list[int], new: int, submitted: float) -> Stream:
        """One streamed greedy /completion of exactly `new` tokens from token ids, sent at
        `submitted` (perf_counter; token times on the same clock)."""
        out = Stream(submitted=submitted)
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
                out.add(chunk.get("tokens") or [], time.perf_counter())
                out.prompt_tokens = int(chunk.get("tokens_evaluated", out.prompt_tokens))
                if "timings" in chunk:  # the final chunk: how much of the prompt was cached
                    timings = chunk["timings"]
                    out.cached_tokens = int(timings.get("cache_n", 0))
                    # and how many it generated: its chunks leave out the tokens of a
                    # character not yet whole (byte tokens), so count from here
                    missing = int(timings.get("predicted_n", 0)) - len(out.tokens)
                    if missing > 0:
                        out.held_back = missing
                        out.add([-1] * missing, time.perf_counter())
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

    def burst(self, jobs: Sequence[Job]) -> list[Stream]:
        """All `jobs` sent at once, one thread each, every one submitted at the common t0."""
        results: list[Stream | BaseException | None] = [None] * len(jobs)
        go = threading.Barrier(len(jobs) + 1)
        t0_box: list[float] = []

        def one(i: int, job: Job) -> None:
            go.wait()
            try:
                results[i] = self.stream(job.prompt_ids, job.max_new, t0_box[0])
            except BaseException as exc:  # reported below, in the caller's thread
                results[i] = exc

        threads = [
            threading.Thread(target=one, args=(i, j), daemon=True) for i, j in enumerate(jobs)
        ]
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

    def cpu_seconds(self) -> float:
        """CPU seconds the server has used so far (0 once it is gone)."""
        try:
            return cpu_seconds(self.proc.pid)
        except OSError:
            return 0.0

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


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
    proc = run_tool(args, "llama-batched-bench")
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
    proc = run_tool(args, "llama-perplexity")
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    if final is None:
        raise RuntimeError(f"llama-perplexity printed no estimate: {out.strip()[-400:]}")
    windows = re.search(r"over (\d+) chunks, n_ctx=(\d+)", out)
    return {
        "ppl": float(final.group(1)),
        "ppl_err": float(final.group(2)),
        "windows": int(windows.group(1)) if windows else None,
        "ctx": int(windows.group(2)) if windows else ctx,
        "running_ppl": [float(x) for x in re.findall(r"\[\d+\]([0-9.]+)", out)],
        "seconds": seconds,
    }
