"""The worker core: the physical KV pool, per-sequence state, and one step of the model.

`ModelRunner.step(plan)` applies the plan's deltas (drop, add, extend page tables), runs one
forward pass over the flattened batch (decode tokens and prefill chunks together), and samples
every sequence the step brings level with its known tokens. No I/O: the gRPC adapter and the
in-process engine both call it.

Logprobs: a sequence asking for SamplingParams.logprobs = k gets the k likeliest tokens with each
sampled one. One asking for prompt_logprobs gets its prompt's logprobs with its first token: logits
are taken at every prompt position as its prefill chunks run, and the positions a prefix-cache hit
skipped are run again in its first chunk (their KV is read, not rewritten, so sequences sharing
those pages are untouched).

A sequence with structured output samples under its grammar (kvmesh.grammar), started when the
sequence is added and replayed over the output it already has, so a recomputed sequence continues
where it was. The model's grammars (its tokenizer.json) are built on the first such sequence.

It trusts no plan: a new sequence with a token outside the vocabulary, a page outside the pool or
sampling values outside their limits, a chunk it cannot run, or a row the sampler cannot draw
fails that sequence alone (`StepResult.failed`, with the reason); the step goes on for the rest.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.grammar import Grammars
from kvmesh.kernels.attention import SequenceSlice, causal_mask
from kvmesh.params import InvalidRequest, validate_sampling, validate_vocabulary
from kvmesh.services.worker.model import BatchInput, CausalLM
from kvmesh.services.worker.page_store import PageStore
from kvmesh.services.worker.sampling import SamplingRow, sample, top_logprobs
from kvmesh.step import NewSequence, PromptLogprobs, SampledToken, ScheduledChunk, StepPlan, StepResult


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the OS hands out as it is first written (calloc of a large
    block maps fresh zero pages), so a large KV pool costs the pages sequences use, not a memset of
    the whole pool at start (torch.zeros of 4 GiB takes seconds)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


MADV_POPULATE_WRITE = 23  # Linux 5.14+: back a range with memory, as a write would, without writing it
_PAGE = 4096


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


class KVPool:
    """Preallocated K and V tensors, `[layers, num_pages * page_size, kv_heads, head_dim]` each, on
    the model's device."""

    def __init__(self, model: CausalLM, num_pages: int, page_size: int):
        cfg = model.cfg
        shape = (cfg.num_layers, num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        if model.device.type == "cpu":
            self.k = lazily_zeroed(shape, model.dtype)
            self.v = lazily_zeroed(shape, model.dtype)
        else:
            self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
            self.v = torch.zeros(shape, dtype=model.dtype, device=model.device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def populate(self, pages_per_chunk: int = 1024) -> str | None:
        """Backs a CPU pool with memory now, lowest pages first (the order the scheduler first hands
        them out), `pages_per_chunk` pages of every layer's K and V at a time, with
        madvise(MADV_POPULATE_WRITE): the page tables are filled as a write would fill them, and
        nothing is written, so it runs beside steps that write the pool. Otherwise the step that
        first writes a page pays for it: on these virtual machines 0.3-3 s per GiB, and a served
        worker whose pool was new spent 11% of its steps' time in the KV write (bfloat16 on an
        Intel Xeon with AMX, docs/benchmarks.md). It stops before the machine's available memory
        would fall under an eighth of its total (a pool set larger than the memory is left to be
        mapped as it is written, as before, rather than taking the memory at start). Returns None
        when the whole pool is backed, else why not."""
        if self.k.device.type != "cpu" or not sys.platform.startswith("linux"):
            return "the pool is not in this Linux process's memory"
        import psutil

        madvise = _madvise()
        layers, slots = self.k.shape[0], self.k.shape[1]
        slot_bytes = self.k[0, 0].numel() * self.k.element_size()
        layer_bytes = slots * slot_bytes
        chunk = pages_per_chunk * self.page_size * slot_bytes
        reserve = psutil.virtual_memory().total // 8
        for start in range(0, layer_bytes, chunk):
            if psutil.virtual_memory().available < reserve + 2 * layers * chunk:
                return (f"stopped at {2 * layers * start >> 20} MiB of {self.nbytes >> 20}: the machine's available "
                        f"memory is near an eighth of its total; the rest is mapped as it is written")
            for tensor in (self.k, self.v):
                base, end = tensor.data_ptr(), tensor.data_ptr() + layers * layer_bytes
                for layer in range(layers):
                    lo = base + layer * layer_bytes + start
                    hi = min(lo + chunk, base + (layer + 1) * layer_bytes)
                    lo -= lo % _PAGE  # the page holding the range's first byte is the buffer's
                    hi = min(hi + (-hi) % _PAGE, end - end % _PAGE)  # not past the buffer's last whole page
                    if hi > lo and madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                        return f"madvise(MADV_POPULATE_WRITE) failed ({os.strerror(ctypes.get_errno())}; Linux 5.14+ has it)"
        return None

    @staticmethod
    def pages_for_budget(model: CausalLM, memory_bytes: int, page_size: int) -> int:
        """How many pages fit in `memory_bytes` of KV memory."""
        cfg = model.cfg
        itemsize = torch.empty((), dtype=model.dtype).element_size()
        page_bytes = 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * itemsize
        return max(1, memory_bytes // page_bytes)


@dataclass
class SequenceState:
    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_row: SamplingRow
    page_ids: list[int]
    num_computed_tokens: int
    page_size: int
    contiguous: bool = False  # page_ids is one run of consecutive pages: attention reads it in place
    # prompt_logprobs: what is collected so far (sent with the first token), and the prompt
    # positions a prefix hit skipped, run again (without writing their KV) in the first chunk.
    prompt_logprobs: PromptLogprobs | None = None
    rerun_prefix: int = 0
    # The cache slot of every position the pages hold, grown by doubling as pages arrive, so a
    # step reads a sequence's slots as a view instead of expanding its page table again.
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full computed pages (PageStore)

    def extend(self, pages: list[int]) -> None:
        if not pages:
            return
        prev = self.page_ids[-1] if self.page_ids else None
        for page in pages:
            self.contiguous = prev is None or (self.contiguous and page == prev + 1)
            prev = page
        start, ps = len(self.page_ids) * self.page_size, self.page_size
        self.page_ids.extend(pages)
        end = len(self.page_ids) * ps
        if end > self.slots.shape[0]:
            grown = torch.empty(max(end, 2 * self.slots.shape[0]), dtype=torch.long)
            grown[:start] = self.slots[:start]
            self.slots = grown
        new = torch.tensor(pages, dtype=torch.long)
        self.slots[start:end] = (new[:, None] * ps + torch.arange(ps)).flatten()


def _drawn_on_device(sampled: list[SequenceState]) -> bool:
    """Whether every row is a plain greedy pick, which the sampler does where the logits are (only
    the chosen ids and their logprobs then leave the device)."""
    return all(s.sampling_row.params.greedy and not s.sampling_row.processed and s.sampling_row.grammar is None
               for s in sampled)


class ModelRunner:
    """Runs steps for the sequences a scheduler places on this worker."""

    def __init__(self, model: CausalLM, num_pages: int, page_size: int = 16, offload_bytes: int = 0):
        self.model = model
        self.page_size = page_size
        self.pool = KVPool(model, num_pages, page_size)
        self.store = PageStore(self.pool.k, self.pool.v, page_size, offload_bytes)
        self.seqs: dict[str, SequenceState] = {}

    @property
    def max_context(self) -> int:
        """The longest sequence it can serve: the model's context, or the whole KV pool where that
        holds fewer tokens (a longer request could never run, not even alone, so it is refused)."""
        return min(self.model.cfg.max_position_embeddings, self.pool.num_pages * self.page_size)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The model's grammars; ValueError when its folder (or tokenizer.json) is unknown."""
        cfg = self.model.cfg
        try:
            return Grammars.from_folder(self.model.folder, cfg.vocab_size, list(cfg.eos_token_ids))
        except (TypeError, OSError) as e:
            raise ValueError(f"structured_output: the model's tokenizer.json cannot be read ({e})") from None

    def _add(self, new: NewSequence) -> str | None:
        """Adds the sequence; why not, when its grammar cannot start."""
        prompt = new.token_ids[: new.num_prompt_tokens]
        output = list(new.token_ids[new.num_prompt_tokens :])
        row = SamplingRow(new.sampling, prompt, output)
        if new.sampling.structured_output is not None:
            try:
                row.grammar = self.grammars.start(new.sampling.structured_output, output)
            except ValueError as e:
                return str(e)
        self.seqs[new.seq_id] = SequenceState(
            seq_id=new.seq_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_row=row,
            page_ids=[],
            num_computed_tokens=new.num_computed_tokens,
            page_size=self.page_size,
        )
        state = self.seqs[new.seq_id]
        state.extend(new.page_ids)
        prefix = new.num_computed_tokens // self.page_size  # pages of a prefix hit: their KV is kept
        self.store.hand_out(new.page_ids[prefix:])
        self.store.chain(state.hashes, state.token_ids, state.page_ids, prefix * self.page_size)
        # Collected only before the first token: a recomputed sequence has sent them already.
        if new.sampling.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens:
            state.prompt_logprobs = PromptLogprobs([], [], [])
            state.rerun_prefix = new.num_computed_tokens
        return None

    def _new_sequence_problem(self, new: NewSequence) -> str | None:
        """Why this worker cannot take the new sequence, or None."""
        ids, vocab = new.token_ids, self.model.cfg.vocab_size
        if not ids:
            return "token_ids: must not be empty"
        if len(ids) > self.model.cfg.max_position_embeddings:
            return f"token_ids: {len(ids)} tokens, over the model's context of {self.model.cfg.max_position_embeddings}"
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            return f"token_ids: token id {bad} is outside the vocabulary [0, {vocab})"
        if not 0 < new.num_prompt_tokens <= len(ids):
            return f"num_prompt_tokens: must be in [1, {len(ids)}], got {new.num_prompt_tokens}"
        if not 0 <= new.num_computed_tokens < len(ids):
            return f"num_computed_tokens: must be in [0, {len(ids)}), got {new.num_computed_tokens}"
        if (page := self._page_outside_pool(new.page_ids)) is not None:
            return f"page_ids: page {page} is outside the pool [0, {self.pool.num_pages})"
        try:
            validate_sampling(new.sampling)
            validate_vocabulary(new.sampling, vocab)
        except InvalidRequest as e:
            return f"sampling: {e}"
        return None

    def _chunk_problem(self, chunk: ScheduledChunk, state: SequenceState | None) -> str | None:
        """Why this chunk cannot run, or None."""
        if state is None:
            return "scheduled but unknown to the worker (never sent as new, or dropped)"
        if (page := self._page_outside_pool(chunk.new_page_ids)) is not None:
            return f"new_page_ids: page {page} is outside the pool [0, {self.pool.num_pages})"
        end = state.num_computed_tokens + chunk.num_tokens
        if chunk.num_tokens < 1 or end > len(state.token_ids):
            return (f"num_tokens: {chunk.num_tokens} tokens after the {state.num_computed_tokens} computed "
                    f"do not lie within its {len(state.token_ids)} tokens")
        if end > self.model.cfg.max_position_embeddings:
            return f"num_tokens: position {end} is over the model's context of {self.model.cfg.max_position_embeddings}"
        if end > (len(state.page_ids) + len(chunk.new_page_ids)) * self.page_size:
            return f"{end} tokens do not fit its {len(state.page_ids) + len(chunk.new_page_ids)} pages"
        return None

    def _page_outside_pool(self, pages: list[int]) -> int | None:
        if pages and (min(pages) < 0 or max(pages) >= self.pool.num_pages):
            return next(p for p in pages if not 0 <= p < self.pool.num_pages)
        return None

    def _runnable(self, scheduled: list[ScheduledChunk], failed: dict[str, str]) -> list[ScheduledChunk]:
        """The chunks that can run; every other one fails its sequence alone (added to `failed`)."""
        seen: set[str] = set()
        for chunk in scheduled:
            problem = failed.get(chunk.seq_id) or self._chunk_problem(chunk, self.seqs.get(chunk.seq_id))
            if chunk.seq_id in seen:
                problem = "scheduled twice in one step"
            seen.add(chunk.seq_id)
            if problem is not None:
                failed[chunk.seq_id] = problem
        for seq_id in failed:
            self.seqs.pop(seq_id, None)
        return [c for c in scheduled if c.seq_id not in failed]

    def _build_batch(self, chunks: list[ScheduledChunk]) -> tuple[BatchInput, list[SequenceState], list[tuple[SequenceState, int]]]:
        """The flattened batch, the sequences it samples, and the sequences collecting prompt
        logprobs with how many prompt positions' logits each gets (their rows follow the sampled
        ones in `logit_rows`)."""
        tokens, positions, slots, seqs, logit_rows, sampled = [], [], [], [], [], []
        prompt_rows, prompt_states, skip_kv = [], [], []
        row, ps = 0, self.page_size
        window = self.model.cfg.sliding_window
        for chunk in chunks:
            state = self.seqs[chunk.seq_id]
            self.store.hand_out(chunk.new_page_ids)
            state.extend(chunk.new_page_ids)
            end = state.num_computed_tokens + chunk.num_tokens
            start, state.rerun_prefix = state.num_computed_tokens - state.rerun_prefix, 0
            if start < state.num_computed_tokens:  # a prefix hit run again: its KV is in the cache already
                skip_kv.append((row, row + state.num_computed_tokens - start))
            ctx_slots = state.slots[:end]
            tokens.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            pages = state.page_ids  # the new tokens' slots in plain ints: no tensor op per sequence
            slots.extend(pages[pos // ps] * ps + pos % ps for pos in range(start, end))
            first_slot = state.page_ids[0] * self.page_size if state.contiguous else None
            seqs.append(SequenceSlice(row, row + end - start, ctx_slots, causal_mask(end - start, end, window),
                                      first_slot=first_slot))
            if state.prompt_logprobs is not None:  # logits at prompt positions p score token p + 1
                scored = range(start, min(end, state.num_prompt_tokens - 1))
                prompt_rows.extend(row + p - start for p in scored)
                prompt_states.append((state, len(scored)))
            row += end - start
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                logit_rows.append(row - 1)
                sampled.append(state)
        kv_rows = None
        if skip_kv:
            keep = torch.ones(row, dtype=torch.bool)
            for a, b in skip_kv:
                keep[a:b] = False
            kv_rows = keep.nonzero().squeeze(1)
        batch = BatchInput(
            token_ids=torch.tensor(tokens, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slots=torch.tensor(slots, dtype=torch.long),
            seqs=seqs,
            logit_rows=torch.tensor(logit_rows + prompt_rows, dtype=torch.long),
            kv_rows=kv_rows,
            page_size=ps,
        )
        return batch.to(self.model.device), sampled, prompt_states

    @staticmethod
    def _collect_prompt_logprobs(logprobs: torch.Tensor, prompt_states: list[tuple[SequenceState, int]]) -> None:
        """Appends each sequence's share of `logprobs` (its prompt positions' rows, in order) to what it collected."""
        at = 0
        for state, n in prompt_states:
            collected = state.prompt_logprobs
            first = len(collected.logprobs) + 1  # the prompt token the first row scores
            rows = logprobs[at : at + n]
            at += n
            next_ids = torch.tensor(state.token_ids[first : first + n], dtype=torch.long)
            collected.logprobs.extend(rows.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist())
            ids, values = top_logprobs(rows, state.sampling_row.params.prompt_logprobs)
            for i, v in zip(ids, values):
                collected.top_ids.extend(i)
                collected.top_logprobs.extend(v)

    def step(self, plan: StepPlan) -> StepResult:
        """Applies the plan's deltas, runs the forward pass and samples; returns the new tokens, and
        the sequences that failed alone (seq id -> why; the worker has forgotten them)."""
        failed: dict[str, str] = {}
        for seq_id in plan.dropped:
            self.seqs.pop(seq_id, None)
        for new in plan.new:
            if (problem := self._new_sequence_problem(new) or self._add(new)) is not None:
                failed[new.seq_id] = problem
        chunks = self._runnable(plan.scheduled, failed)
        if not chunks:
            return self._result([], 0.0, failed)
        started = time.perf_counter()
        batch, sampled, prompt_states = self._build_batch(chunks)
        logits = self.model.forward(batch, self.pool.k, self.pool.v)
        for chunk in chunks:  # their KV is written: full pages can be read by others now
            state = self.seqs[chunk.seq_id]
            self.store.chain(state.hashes, state.token_ids, state.page_ids, state.num_computed_tokens)
        if logits.device.type != "cpu" and (prompt_states or not _drawn_on_device(sampled)):
            logits = logits.cpu()  # the sampler's penalties, biases, grammars and draws run on the host
        if prompt_states:
            self._collect_prompt_logprobs(torch.log_softmax(logits[len(sampled):], dim=-1), prompt_states)
        logits = logits[: len(sampled)]
        ids, logprobs, failures = sample(logits, [s.sampling_row for s in sampled]) if sampled else ([], [], {})
        out = []
        for i, (state, token_id, logprob) in enumerate(zip(sampled, ids, logprobs)):
            if i in failures:
                failed[state.seq_id] = failures[i]
                del self.seqs[state.seq_id]
                continue
            if (refused := state.sampling_row.accept(token_id)) is not None:
                failed[state.seq_id] = refused
                del self.seqs[state.seq_id]
                continue
            state.token_ids.append(token_id)
            out.append(self._sampled_token(state, token_id, logprob, logits[i]))
        return self._result(out, time.perf_counter() - started, failed)

    def _result(self, tokens: list[SampledToken], forward_s: float, failed: dict[str, str]) -> StepResult:
        tier_stored, tier_evicted = self.store.take_reports()
        return StepResult(tokens=tokens, forward_s=forward_s, failed=failed, tier_stored=tier_stored,
                          tier_evicted=tier_evicted)

    @staticmethod
    def _sampled_token(state: SequenceState, token_id: int, logprob: float, logits: torch.Tensor) -> SampledToken:
        """The token as sent: with its alternatives and the prompt's logprobs when the sequence asked
        (its logprob then read from the same log_softmax as theirs, so it equals its own entry)."""
        k, prompt = state.sampling_row.params.logprobs, state.prompt_logprobs
        if not k and prompt is None:
            return SampledToken(state.seq_id, token_id, logprob)
        state.prompt_logprobs = None  # sent once, with the first token
        raw = torch.log_softmax(logits, dim=-1)
        logprob = raw[token_id].item()
        ids, values = top_logprobs(raw.unsqueeze(0), k)
        return SampledToken(state.seq_id, token_id, logprob, tuple(ids[0]), tuple(values[0]), prompt)
