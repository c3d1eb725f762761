"""The in-process engine: scheduler, page pool and model runner composed without gRPC.

It serves offline batch inference and is the baseline that measures what the mesh costs. The
mesh wraps these same cores in services; nothing here is engine-only logic except the loop.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvmesh.params import SamplingParams, StoppingParams, validate_request
from kvmesh.services.kvcache.pages import PagePool, PageStats
from kvmesh.services.scheduler.core import Scheduler, SchedulerConfig, TokenEvent
from kvmesh.services.scheduler.request import FinishReason, Request
from kvmesh.services.worker.model import CausalLM
from kvmesh.services.worker.runner import KVPool, ModelRunner


@dataclass(frozen=True)
class EngineConfig:
    """model: a checkpoint folder (None: the default model). KV memory is `kv_memory_bytes`
    unless `num_pages` is given. device "auto" is CUDA when torch sees one; dtype None is
    bfloat16 on CUDA and the checkpoint's on the CPU. A scheduler config without
    `max_batched_tokens` takes the model's offline step size (`default_step_tokens`: 2,048 for
    bfloat16 on a CPU that multiplies it natively, AVX512-BF16 or AMX; else 1,024)."""

    model: str | Path | None = None
    device: str = "auto"
    dtype: str | None = None
    page_size: int = 16
    kv_memory_bytes: int = 1 << 30
    num_pages: int | None = None
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass
class Completion:
    """One finished request, as offline inference reports it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    num_cached_prompt_tokens: int
    num_preemptions: int


class LLMEngine:
    """add_request() queues a validated request; step() runs one batch and returns token events."""

    def __init__(self, config: EngineConfig | None = None, model: CausalLM | None = None):
        self.config = config = config or EngineConfig()
        if model is None:
            model_dir = config.model
            if model_dir is None:
                from kvmesh.modelgen import default_model_dir

                model_dir = default_model_dir()
            from kvmesh.services.worker.device import default_dtype, resolve_device

            dev = resolve_device(config.device)
            model = CausalLM.load(model_dir, default_dtype(dev, config.dtype), dev)
        self.model = model
        num_pages = config.num_pages or KVPool.pages_for_budget(model, config.kv_memory_bytes, config.page_size)
        self.pool = PagePool(num_pages, config.page_size, config.enable_prefix_caching)
        self.runner = ModelRunner(model, num_pages, config.page_size)
        scheduling = config.scheduler
        if scheduling.max_batched_tokens is None:
            from kvmesh.services.worker.device import default_step_tokens

            scheduling = replace(scheduling, max_batched_tokens=default_step_tokens(model.device, model.dtype, offline=True))
        self.scheduler = Scheduler(self.pool, scheduling)
        self._seeds = random.Random()

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams = SamplingParams(),
        stopping: StoppingParams = StoppingParams(),
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validates and queues a request; raises InvalidRequest naming the field and the limit."""
        cfg = self.model.cfg
        validate_request(prompt_token_ids, sampling, stopping, max_context=self.max_context, vocab_size=cfg.vocab_size)
        if sampling.seed is None:
            # A fixed seed per request makes its stream reproducible through preemption.
            sampling = replace(sampling, seed=self._seeds.getrandbits(63))
        req = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            stopping=stopping,
            eos_token_ids=cfg.eos_token_ids,
            priority=priority,
        )
        self.scheduler.check_fits(req)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> TokenEvent | None:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        result = self.runner.step(plan)
        events = self.scheduler.update(plan, result)
        for seq_id, why in result.failed.items():  # failed alone in the runner: ends with ERROR
            if (event := self.scheduler.abort(seq_id, FinishReason.ERROR)) is not None:
                event.message = why
                events.append(event)
        return events

    def page_stats(self) -> PageStats:
        return self.pool.stats()

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
        stopping: StoppingParams | list[StoppingParams] = StoppingParams(),
    ) -> list[Completion]:
        """Runs every prompt to completion; results in input order."""
        n = len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling] * n
        stoppings = stopping if isinstance(stopping, list) else [stopping] * n
        reqs = [self.add_request(p, s, t) for p, s, t in zip(prompts, samplings, stoppings)]
        while self.has_unfinished():
            self.step()
        return [completion_of(r) for r in reqs]


def completion_of(req: Request) -> Completion:
    return Completion(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        logprobs=list(req.output_logprobs),
        finish_reason=req.finish_reason,
        num_cached_prompt_tokens=req.num_cached_prompt_tokens,
        num_preemptions=req.num_preemptions,
    )


def set_threads(num_threads: int | None) -> None:
    """Sets torch's intra-op threads (None: leave torch's default, one per core)."""
    if num_threads:
        torch.set_num_threads(num_threads)
