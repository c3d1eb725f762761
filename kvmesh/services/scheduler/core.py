"""The continuous-batching scheduler for one worker: admission, token budget, preemption.

Each step, `schedule()` gives every running request its next chunk (one token when decoding, up
to the remaining token budget when prefilling), growing page tables as needed; when pages run
out, it preempts a victim (frees its pages; it is recomputed later and resumes its stream where
it stopped). Then it admits waiting requests, highest priority first, while pages and budget
last. `update()` takes the worker's sampled tokens, applies stop rules and frees finished
requests' pages in the same step.

A waiting request whose next uncached pages a running request is computing now (the same system
prompt, arrived together; `min_shared_wait_tokens` of them at least) waits for them instead of
computing them too, and takes them from the prefix cache a step or a chunk later (SGLang's in-batch
prefix caching); the requests behind it are admitted meanwhile. Continuous batching only.

`schedule(ahead=True)` plans the step after the one out, before its result (overlapped steps, as
vLLM's async scheduling): the worker keeps each sequence's tokens, so a plan names how many
tokens to compute, not which, and a request decodes the token the step out samples for it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, replace

from kvmesh.params import InvalidRequest
from kvmesh.services.kvcache.eviction import VICTIM_POLICIES, pick_victim
from kvmesh.services.kvcache.pages import PagePool, chained_hashes
from kvmesh.services.scheduler.request import FinishReason, Request, Status
from kvmesh.step import NewSequence, ScheduledChunk, StepPlan, StepResult

BATCHING_MODES = ("continuous", "static", "static-unpadded")
DEFAULT_STEP_TOKENS = 1024


@dataclass(frozen=True)
class SchedulerConfig:
    """max_batched_tokens: tokens per step (decode tokens plus prefill chunks); None: 1024, or the
    model's own step size (`default_step_tokens`) in the in-process engine and where the scheduler
    service's worker reports one.
    max_num_seqs: running requests at most. victim_policy: which running request is preempted
    when pages run out: newest admitted, lowest priority (then newest), or largest KV.
    aging_s: a waiting request gains one priority point per aging_s seconds (0: no aging).
    max_prefill_chunk: caps one request's prefill tokens per step, so a long prompt leaves budget
    for short requests to start beside it instead of blocking them until it is done.
    batching: continuous (admit every step) or static, the baseline continuous batching is
    measured against: a batch is filled (up to max_num_seqs, over several steps when one step's
    token budget cannot prefill it all) and runs until its longest request ends before the next is
    admitted. In `static` a finished request's row stays in the batch and keeps decoding, its
    tokens discarded, as a row of a fixed-shape batch does (transformers' generate, the classic
    static servers); in `static-unpadded` finished rows leave the batch, saving their compute.
    min_shared_wait_tokens: a waiting request waits for prompt pages a running request is computing
    (in-batch prefix sharing) only when at least this many of its tokens would come from them; a
    short shared head (a chat template) is not worth the step it would wait.
    backlog_decode_every: while requests wait that there is room to admit (a backlog of prompts),
    running requests decode first in one step of this many; the other steps give the waiting
    prompts the budget first and the decodes what is left (continuous batching only). 1: decodes
    first in every step (vLLM's order). 2 (the default): under a backlog each running request
    still decodes at least every other step, and the prompts get the share of the machine the
    other decodes took: on a saturated CPU worker (AMD EPYC Zen 4, float32, 4 requests/s), time to
    first token p50 0.81-1.10x vLLM's by pass where decodes first in every step gave 1.11-1.30x,
    the longest pause in a stream level with vLLM's (docs/benchmarks.md)."""

    max_batched_tokens: int | None = None
    max_num_seqs: int = 128
    victim_policy: str = "newest"
    aging_s: float = 10.0
    batching: str = "continuous"
    max_prefill_chunk: int = 0  # prefill tokens one request may take in a step (0: the whole budget)
    min_shared_wait_tokens: int = 256
    backlog_decode_every: int = 2

    def __post_init__(self):
        if self.backlog_decode_every < 1:
            raise ValueError(f"backlog_decode_every must be >= 1 (1: decodes first in every step), got {self.backlog_decode_every}")
        if self.min_shared_wait_tokens < 1:
            raise ValueError(f"min_shared_wait_tokens must be >= 1, got {self.min_shared_wait_tokens}")
        if self.max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be >= 0 (0: no cap), got {self.max_prefill_chunk}")
        if self.aging_s < 0:
            raise ValueError(f"aging_s must be >= 0 (0 disables aging), got {self.aging_s}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.victim_policy not in VICTIM_POLICIES:
            raise ValueError(f"victim_policy must be one of {', '.join(VICTIM_POLICIES)}, got {self.victim_policy!r}")


@dataclass
class TokenEvent:
    """A token for a request's stream (token_id None on a finish without a new token, e.g. cancel)."""

    request: Request
    token_id: int | None
    logprob: float | None
    finish_reason: FinishReason | None = None
    message: str = ""  # why, for an ERROR finish or a refusal
    # The request never started and is refused for load: its stream ends RESOURCE_EXHAUSTED with a
    # retry hint, which a client retries, rather than with a finish.
    refused: bool = False


class Scheduler:
    """Queues and batches the requests of one worker whose pages `pool` accounts for."""

    def __init__(self, pool: PagePool, config: SchedulerConfig | None = None, max_context: int | None = None):
        self.pool = pool
        config = config or SchedulerConfig()
        if config.max_batched_tokens is None:
            config = replace(config, max_batched_tokens=DEFAULT_STEP_TOKENS)
        self.config = config
        self.max_context = max_context  # the model's; a padding row stops there
        self.waiting: list[Request] = []  # sorted by _admission_key
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._to_drop: list[str] = []  # worker-side state to forget at the next step
        self._watermark = max(1, pool.num_pages // 100)
        self._chunk_cap = self.config.max_prefill_chunk or self.config.max_batched_tokens
        self.num_preemptions = 0
        self.num_deferred = 0  # requests that waited for pages a running request was computing
        # Page hash -> (the running request computing that page, its index): pages not in the prefix
        # index yet that a waiting request may wait for instead of computing them again.
        self._computing: dict[bytes, tuple[Request, int]] = {}
        self.seq_limit = self.config.max_num_seqs  # lowered for a while by an admission ramp
        self.ahead_blocked = False  # the last plan ahead stopped short of pages: the next waits for the step out
        self._prompts_first_steps = 0  # consecutive steps that gave waiting prompts the budget first
        # Static batching: a batch keeps admitting, across steps when one step's token budget cannot
        # prefill it all, until it is full, the queue is empty or pages run out; then it is closed
        # until its last request ends.
        self._batch_open = True
        # Padded static batching: rows of finished requests still decoding -> their computed tokens.
        self.padding: dict[str, int] = {}

    def _admission_key(self, r: Request):
        # Every waiting request ages at the same rate, so priority + age / aging_s orders them the
        # same at any moment as priority - arrival / aging_s: the order is fixed at insertion, and
        # a request is overtaken by newcomers only for (their priority - its priority) * aging_s.
        aged = r.priority - r.arrival_time / self.config.aging_s if self.config.aging_s else r.priority
        return (-aged, r.arrival_time)

    # -- intake --------------------------------------------------------------------------------

    def check_fits(self, request: Request) -> None:
        """Raises InvalidRequest when the request could never fit this worker's pool, even alone."""
        pages = self.pool.pages_needed(len(request.prompt_token_ids) + request.stopping.max_new_tokens)
        if pages > self.pool.num_pages:
            raise InvalidRequest(
                "max_new_tokens",
                f"prompt plus max_new_tokens needs {pages} KV pages, over this worker's {self.pool.num_pages}",
            )

    def add(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.padding:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=self._admission_key)

    def waiting_ahead_of(self, request: Request) -> list[Request]:
        """The waiting requests that admission would take before `request` were it queued now."""
        return self.waiting[:self.ahead_count(request)]

    def ahead_count(self, request: Request) -> int:
        """How many waiting requests admission would take before `request` (they lead `waiting`)."""
        return bisect.bisect_right(self.waiting, self._admission_key(request), key=self._admission_key)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> TokenEvent | None:
        """Ends a request now and frees its pages; None if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, reason)
        return TokenEvent(req, None, None, reason)

    def take_all(self) -> list[Request]:
        """Removes every request (running ones first, then the queue, in order) without finishing
        them, frees their pages and resets them for recompute: for moving them to another worker."""
        taken = []
        for req in self.running + self.waiting:
            self.pool.release(req.request_id)
            self._forget_computing(req)
            req.wait_for_page = None
            if req.status is Status.RUNNING:
                req.num_preemptions += 1
            req.status = Status.WAITING
            req.num_computed_tokens = req.num_inflight_tokens = 0
            req.fetched = None  # pages fetched into this worker: nothing to the next one
            taken.append(req)
        self.running, self.waiting, self.requests = [], [], {}
        self._release_padding()
        return taken

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, ahead: bool = False) -> StepPlan:
        """The next step's plan. With `ahead`, the step after the one out, planned before its result:
        each running request goes on from where that step leaves it, one whose last token (by
        max_new_tokens) comes in that step is left out, and nothing is preempted: when pages run
        short the plan ends there, without admissions, and `ahead_blocked` says that the next plan
        must wait for the steps out (and may preempt). A request that ends on a token sampled in
        the step out (EOS, a stop token) still has one token computed in this one, discarded.
        Continuous batching only (a static batch's padding rows are not planned ahead)."""
        if ahead and self.config.batching != "continuous":
            raise ValueError(f"steps overlap in continuous batching only, not {self.config.batching!r}")
        plan = StepPlan(dropped=self._to_drop)
        self._to_drop = []
        chunks: dict[str, ScheduledChunk] = {}
        self.ahead_blocked = False
        prompts_first = self._prompts_first()
        budget, preempted, passed_over = self._schedule_running(
            list(self.running), plan, chunks, self.config.max_batched_tokens, ahead, pass_decodes=prompts_first)
        if self.ahead_blocked:
            return plan
        budget = self._schedule_padding(plan, budget)
        static = self.config.batching != "continuous"
        if static and not self.running:
            self._batch_open = True
        if not preempted and (not static or self._batch_open):
            budget_ran_out = self._admit(plan, chunks, budget)
            if static and not budget_ran_out:
                self._batch_open = False
        if passed_over:
            # The decodes take what the prompts left. Where this plan admits nothing, they may preempt
            # as in a decodes-first step; else a victim could be a request this plan admits, so pages
            # short end the decodes here. Either way the next step decodes first (with `every` 2): a
            # prompts-first step counts as one even when running prompts' chunks took its budget.
            left = self.config.max_batched_tokens - sum(c.num_tokens for c in plan.scheduled)
            self._schedule_running(passed_over, plan, chunks, left, ahead, preempt=not plan.new)
        self._prompts_first_steps = self._prompts_first_steps + 1 if prompts_first else 0
        return plan

    def _prompts_first(self) -> bool:
        """Whether this step gives waiting prompts the budget before running requests' decodes:
        under a backlog (requests wait and there is room to admit them), in all but one step of
        `backlog_decode_every`."""
        every = self.config.backlog_decode_every
        return (every > 1 and self.config.batching == "continuous" and self._prompts_first_steps < every - 1
                and bool(self.waiting) and len(self.running) < min(self.seq_limit, self.config.max_num_seqs))

    def _schedule_running(self, reqs: list[Request], plan: StepPlan, chunks: dict[str, ScheduledChunk], budget: int,
                          ahead: bool, pass_decodes: bool = False, preempt: bool = True) -> tuple[int, bool, list[Request]]:
        """Gives each running request in `reqs` its next chunk while the budget lasts, growing its
        page table; when pages run short, preempts victims (not `ahead` nor without `preempt`: the
        plan ends there, `ahead` setting `ahead_blocked`). With `pass_decodes`, requests whose next
        chunk is a decode are passed over. Returns the budget left, whether it preempted, and the
        requests passed over."""
        preempted, passed_over = False, []
        grow, cap = self.pool.grow, self._chunk_cap
        for req in reqs:
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            start, known = req.num_computed_tokens + req.num_inflight_tokens, req.num_known_tokens
            if known > len(req.token_ids) and len(req.output_token_ids) + 1 >= req.stopping.max_new_tokens:
                continue  # its last token is being sampled in the step out
            if pass_decodes and known - start == 1 and start >= len(req.prompt_token_ids):
                passed_over.append(req)
                continue
            n = min(known - start, budget, cap)
            while (new_pages := grow(req.request_id, start + n)) is None:
                if ahead or not preempt:
                    self.ahead_blocked = ahead
                    return budget, preempted, passed_over
                if self.padding:  # padding rows give way before any request is preempted
                    seq_id = next(iter(self.padding))
                    self._drop_padding(seq_id)
                    plan.dropped.append(seq_id)
                    continue
                victim = pick_victim(self.running, self.config.victim_policy)
                budget += self._preempt(victim, plan, chunks)
                preempted = True
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                chunks[req.request_id] = chunk = ScheduledChunk(req.request_id, n, new_pages)
                plan.scheduled.append(chunk)
                req.num_inflight_tokens += n
                budget -= n
        return budget, preempted, passed_over

    def expire_waiting(self, max_wait_s: float, now: float | None = None) -> list[TokenEvent]:
        """Refuses requests that have waited longer than max_wait_s without ever being scheduled:
        nothing of theirs was computed or streamed, so each ends CANCELLED here and `refused` (a
        load refusal for its client, with a retry hint), not ERROR. One waiting for the pages of its
        prompt that a running request is computing is being served, not queued: it stays."""
        now = time.monotonic() if now is None else now
        expired = [r for r in self.waiting if r.first_scheduled_time is None and now - r.arrival_time > max_wait_s
                   and not self._waits_for_prefill(r)]
        events = []
        for req in expired:
            event = self.abort(req.request_id, FinishReason.CANCELLED)
            event.message = (f"overloaded: waited {now - req.arrival_time:.1f} s in the queue without starting, "
                             f"over the limit of {max_wait_s:g} s (max_queue_wait_s)")
            event.refused = True
            events.append(event)
        return events

    def _outstanding_pages(self) -> int:
        """Pages running requests still need to hold all the tokens they already know."""
        need = 0
        for r in self.running:
            need += max(0, self.pool.pages_needed(r.num_known_tokens) - len(self.pool.page_table(r.request_id)))
        return need

    def _admit(self, plan: StepPlan, chunks: dict[str, ScheduledChunk], budget: int) -> bool:
        """Admits waiting requests in order while the budget, max_num_seqs and pages allow, passing
        over those that wait for prompt pages a running request is computing (they stay queued). A
        request is admitted only when pages for its whole known sequence (prompt, plus output
        after a preemption) fit beside what running requests still need, though it is given
        pages one chunk at a time; so a flood of long prompts waits instead of thrashing.
        Returns True when only this step's token budget stopped it (the next step may admit more)."""
        outstanding = self._outstanding_pages()
        share = self.config.batching == "continuous" and self.pool.enable_prefix_caching
        at = 0  # waiting[:at] wait for pages running requests are computing
        while at < len(self.waiting) and len(self.running) + len(self.padding) < min(self.seq_limit, self.config.max_num_seqs):
            if budget <= 0:
                return True
            req = self.waiting[at]
            if share and self._still_computing(req.wait_for_page):
                at += 1
                continue
            tokens = req.all_token_ids
            prefix = self.pool.match_prefix(tokens)
            if share and (wait_for := self._shared_run_computing(tokens, prefix)) is not None:
                self.num_deferred += req.wait_for_page is None
                req.wait_for_page = wait_for
                at += 1
                continue
            req.wait_for_page = None
            self.pool.open(req.request_id, prefix)
            computed = len(prefix) * self.pool.page_size
            n = min(req.num_tokens - computed, budget, self._chunk_cap)
            pages = self.pool.grow(req.request_id, computed + n)
            later = self.pool.pages_needed(req.num_tokens) - len(self.pool.page_table(req.request_id))
            spare = self.pool.num_available - outstanding - max(0, later)
            if pages is None or (spare < self._watermark and self.running):
                self.pool.release(req.request_id)
                return False
            outstanding += max(0, later)
            self.waiting.pop(at)
            if share:
                self._note_computing(req, tokens, prefix)
            req.status = Status.RUNNING
            req.num_computed_tokens, req.num_inflight_tokens = computed, n
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = computed
                if req.fetched is not None:  # the part of the hit a fetch brought (unless evicted since)
                    first, fetched, source = req.fetched
                    ps = self.pool.page_size
                    req.num_transferred_prompt_tokens = max(0, min(computed, (first + fetched) * ps) - first * ps)
                    req.transfer_source = source if req.num_transferred_prompt_tokens else ""
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            plan.new.append(
                NewSequence(req.request_id, tokens, len(req.prompt_token_ids), req.sampling, prefix + pages, computed,
                            req.traceparent)
            )
            chunks[req.request_id] = chunk = ScheduledChunk(req.request_id, n, [])
            plan.scheduled.append(chunk)
            budget -= n
        return False

    def _still_computing(self, entry: tuple[Request, int] | None) -> bool:
        """Whether the request in `entry` is running on this worker and has not computed that page yet."""
        if entry is None:
            return False
        owner, page = entry
        return self._running_here(owner) and owner.num_computed_tokens < (page + 1) * self.pool.page_size

    def _waits_for_prefill(self, req: Request) -> bool:
        """Whether `req` waits for pages of a request running here that is still prefilling."""
        if req.wait_for_page is None:
            return False
        owner = req.wait_for_page[0]
        return self._running_here(owner) and owner.num_computed_tokens < len(owner.prompt_token_ids)

    def _running_here(self, req: Request) -> bool:
        return req.status is Status.RUNNING and self.requests.get(req.request_id) is req

    def _shared_run_computing(self, tokens: list[int], prefix: list[int]) -> tuple[Request, int] | None:
        """(the running request, page) computing the first page of `tokens` past its cached `prefix`,
        when running requests compute at least min_shared_wait_tokens of the pages from there on."""
        if not self._computing:
            return None
        ps, k = self.pool.page_size, len(prefix)
        want = -(-self.config.min_shared_wait_tokens // ps)
        if k + want > (len(tokens) - 1) // ps:
            return None  # fewer full pages left than would be worth waiting for
        first = None
        for i, h in chained_hashes(tokens, ps, k, self.pool.hash_of[prefix[-1]] if prefix else None):
            if i == k + want:
                break
            entry = self._computing.get(h)
            if not self._still_computing(entry):
                return None
            first = first or entry
        return first

    def _note_computing(self, req: Request, tokens: list[int], prefix: list[int]) -> None:
        """Records the full pages past `prefix` that the admitted `req` will compute."""
        mine = []
        for i, h in chained_hashes(tokens, self.pool.page_size, len(prefix), self.pool.hash_of[prefix[-1]] if prefix else None):
            if not self._still_computing(self._computing.get(h)):
                self._computing[h] = (req, i)
                mine.append(h)
        req.computing_hashes = mine

    def _forget_computing(self, req: Request) -> None:
        for h in req.computing_hashes:
            if (entry := self._computing.get(h)) is not None and entry[0] is req:
                del self._computing[h]
        req.computing_hashes = []

    def _schedule_padding(self, plan: StepPlan, budget: int) -> int:
        """One decode token for every padding row that can still grow; returns the budget left."""
        for seq_id, computed in list(self.padding.items()):
            if budget == 0:
                break
            if self.max_context is not None and computed + 1 > self.max_context:
                self._drop_padding(seq_id)
                plan.dropped.append(seq_id)
                continue
            new_pages = self.pool.grow(seq_id, computed + 1)
            if new_pages is None:  # a padding row never takes pages from a request
                self._drop_padding(seq_id)
                plan.dropped.append(seq_id)
                continue
            plan.scheduled.append(ScheduledChunk(seq_id, 1, new_pages))
            budget -= 1
        return budget

    def _drop_padding(self, seq_id: str) -> None:
        self.pool.release(seq_id)
        del self.padding[seq_id]

    def _release_padding(self) -> None:
        for seq_id in list(self.padding):
            self._drop_padding(seq_id)
            self._to_drop.append(seq_id)

    def _preempt(self, victim: Request, plan: StepPlan, chunks: dict[str, ScheduledChunk]) -> int:
        """Frees the victim's pages and requeues it; returns the budget its dropped chunk held."""
        self.pool.release(victim.request_id)
        self._forget_computing(victim)
        self.running.remove(victim)
        victim.status = Status.WAITING
        victim.num_computed_tokens = victim.num_inflight_tokens = 0  # no step is out when a plan may preempt
        victim.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, victim, key=self._admission_key)
        plan.dropped.append(victim.request_id)
        chunk = chunks.pop(victim.request_id, None)
        if chunk is None:
            return 0
        plan.scheduled.remove(chunk)
        return chunk.num_tokens

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Advances computed counts, appends sampled tokens, finishes requests that hit a stop."""
        now = time.monotonic()
        ps = self.pool.page_size
        for chunk in plan.scheduled:
            if chunk.seq_id in self.padding:
                self.padding[chunk.seq_id] += chunk.num_tokens  # the token it sampled is discarded
                continue
            req = self.requests.get(chunk.seq_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran (or a padding row released since)
            before = req.num_computed_tokens
            req.num_computed_tokens = after = before + chunk.num_tokens
            req.num_inflight_tokens -= chunk.num_tokens
            if after // ps != before // ps:  # a page filled up: publish it to the prefix index
                self.pool.commit(req.request_id, req.token_ids, after)
        events = []
        for tok in result.tokens:
            req = self.requests.get(tok.seq_id)
            if req is None or req.status is not Status.RUNNING:
                continue
            req.append_output(tok.token_id, tok.logprob)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = req.stop_reason()
            if reason is not None:
                self._finish(req, reason)
            events.append(TokenEvent(req, tok.token_id, tok.logprob, reason))
        return events

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self._forget_computing(req)
        if req.status is Status.RUNNING:
            self.running.remove(req)
            pads = self.config.batching == "static" and reason not in (FinishReason.CANCELLED, FinishReason.ERROR)
            if pads and self.running:
                self.padding[req.request_id] = req.num_computed_tokens
            else:
                self._to_drop.append(req.request_id)
                self.pool.release(req.request_id)
            if not self.running:
                self._release_padding()  # the batch has ended
        else:
            self.pool.release(req.request_id)
        req.status = Status.FINISHED
        req.num_inflight_tokens = 0
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        del self.requests[req.request_id]
