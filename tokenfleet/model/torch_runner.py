"""`TorchRunner`: the engine's `ModelRunner` for the torch Llama model.

It owns the KV pool, the model's reusable tick buffers (through `LlamaModel`) and
one sampler stream per session, and turns the scheduler's `TickPlan` into one
forward pass plus one batched sample:

    plan.decode + plan.prefill  ->  input ids + SeqInputs  ->  LlamaModel.forward
    logits rows of the sampling entries  ->  TickSampler.finish  ->  one token each
                                             (and the logprobs asked for: tick_sampling.py)

A prefill chunk of a session asking for its prompt's logprobs (echo) has the LM head
run over every prompt position it feeds, not its last one alone.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping

import torch

from tokenfleet.model.build import LoadedModel
from tokenfleet.model.cuda_graph import CudaGraphDecode
from tokenfleet.model.kv_pool import KVPool
from tokenfleet.model.tick_inputs import SeqInput
from tokenfleet.model.tick_sampling import Echo, TickSampler
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.seam import (
    DecodeStep,
    ModelSpec,
    ResolvedSampling,
    Sampled,
    TickPlan,
    TokenMasks,
)

ForwardObserver = Callable[[list[int], list[SeqInput]], None]


class TorchRunner:
    """`on_forward`, when given, sees every forward's input ids and sequences before it
    runs (benchmarks record schedules with it; nothing else changes)."""

    def __init__(self, loaded: LoadedModel, *, on_forward: ForwardObserver | None = None) -> None:
        self.loaded = loaded
        self.on_forward = on_forward
        self.model = loaded.model
        cfg = loaded.config
        self._dtype_bytes = torch.empty((), dtype=loaded.dtype).element_size()
        kv_bytes = torch.empty((), dtype=self.model.kv_dtype).element_size()
        eos = () if loaded.tokenizer is None else loaded.tokenizer.eos_token_ids
        self._spec = ModelSpec(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            kv_dtype_bytes=kv_bytes,
            weight_bytes=loaded.weight_bytes,
            vocab_size=cfg.vocab_size,
            max_context=cfg.max_position_embeddings,
            eos_token_ids=frozenset(eos) | frozenset(cfg.eos_token_ids),
            sampling_defaults=loaded.sampling_defaults,
            cache_identity=_identity(loaded),
        )
        self.kv: KVPool | None = None
        self.sampling = TickSampler()  # the sampler streams, logprobs and masks

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.loaded.tokenizer

    def scratch_bytes(self, context_len: int) -> int:
        # One decode token attending over its whole context: gathered K/V, scores,
        # its logits row and sampling buffers.
        return self.loaded.config.scratch_bytes(
            1, context_len=context_len, logit_rows=1, dtype_bytes=self._dtype_bytes
        )

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.kv = self.model.new_kv_pool(num_blocks, block_size)
        graphs = self.model.decode_graph
        if isinstance(graphs, CudaGraphDecode):  # recorded on this pool, short contexts now
            graphs.bind(self.kv, widths=(1, 2, 4, 8))

    def execute(
        self,
        plan: TickPlan,
        sampling: Mapping[str, ResolvedSampling],
        masks: TokenMasks | None = None,
    ) -> list[int] | Sampled:
        if self.kv is None:
            raise RuntimeError("allocate_kv() before execute()")
        ids: list[int] = []
        seqs: list[SeqInput] = []
        sample_rows: list[int] = []
        echoes: list[Echo] = []  # prefill chunks of sessions asking for prompt logprobs
        for row, entry in enumerate(plan.entries):
            if isinstance(entry, DecodeStep):
                ids.append(entry.token_id)
                seqs.append(SeqInput(entry.block_table, entry.position, 1))
            else:
                echo = Echo.of(entry, len(ids))
                if echo is not None:
                    echoes.append(echo)
                ids.extend(entry.token_ids)
                seqs.append(SeqInput(entry.block_table, entry.start, entry.length))
                if not entry.samples:
                    continue
            sample_rows.append(row)
        states = self.sampling.states(plan, sampling)
        if self.on_forward is not None:
            self.on_forward(ids, seqs)
        prompt = None
        if echoes:  # every prompt position's logits these chunks need, after the samples'
            ends = list(itertools.accumulate(s.num_new for s in seqs))
            flat = [ends[r] - 1 for r in sample_rows]
            flat += [r for e in echoes for r in e.rows]
            every = self.model.forward(ids, seqs, self.kv, flat)  # [samples + echoes, vocab]
            logits, prompt = every[: len(sample_rows)], every[len(sample_rows) :]
        else:
            logits = self.model.forward(ids, seqs, self.kv)  # [entries, vocab]
            if len(sample_rows) < len(seqs):
                logits = logits[sample_rows]
        return self.sampling.finish(plan, sampling, masks, states, logits, prompt, echoes)

    def recomputed(self, session_id: str) -> int:
        return 0  # the plan's block tables address the pool: a cached block is there

    def release(self, session_id: str) -> None:
        self.sampling.release(session_id)


def _identity(loaded: LoadedModel) -> str:
    """The model as far as its KV goes: architecture, weights (a digest of a few
    parameters' values: same shapes, other weights, other cache), dtype, quantization."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(loaded.config).encode())
    h.update(f"{loaded.dtype}|{loaded.quant}|{loaded.weight_bytes}".encode())
    if loaded.model.kv_dtype != loaded.dtype:  # K/V rounded to it: other KV bits
        h.update(f"|kv {loaded.model.kv_dtype}".encode())
    if loaded.model.deterministic is not None:  # other numerics: other KV bits
        h.update(b"|deterministic")
    for _, tensor in itertools.islice(loaded.model.state_dict().items(), 4):
        flat = tensor.detach().reshape(-1)[:256]
        h.update(flat.to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()
