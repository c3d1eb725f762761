"""Conversions between the cores' dataclasses and the protobuf messages of the mesh."""

from __future__ import annotations

import math

from kvmesh.params import SamplingParams, StoppingParams, StructuredOutput
from kvmesh.step import NewSequence, PromptLogprobs, SampledToken, ScheduledChunk, StepPlan, StepResult
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import worker_pb2 as wk

# A Step stream's metadata: the scheduler's lease token on the worker (fencing) and its id.
LEASE_TOKEN_METADATA = "kvmesh-lease-token"
SCHEDULER_METADATA = "kvmesh-scheduler"


def sampling_from_proto(m: gen.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        top_k=m.top_k,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        seed=m.seed if m.HasField("seed") else None,
        logprobs=m.logprobs,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        logit_bias=tuple(sorted(m.logit_bias.items())),
        structured_output=structured_from_proto(m.structured_output) if m.HasField("structured_output") else None,
    )


def structured_from_proto(m: gen.StructuredOutput) -> StructuredOutput | None:
    kind = m.WhichOneof("format")
    if kind is None or (kind == "json_object" and not m.json_object):
        return None
    return StructuredOutput(kind, m.json_schema)


def structured_to_proto(s: StructuredOutput) -> gen.StructuredOutput:
    return gen.StructuredOutput(json_schema=s.schema) if s.kind == "json_schema" else gen.StructuredOutput(json_object=True)


def sampling_to_proto(s: SamplingParams) -> gen.SamplingParams:
    m = gen.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                           repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                           frequency_penalty=s.frequency_penalty)
    if s.seed is not None:
        m.seed = s.seed
    m.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        m.prompt_logprobs = s.prompt_logprobs
    m.logit_bias.update(s.logit_bias)
    if s.structured_output is not None:
        m.structured_output.CopyFrom(structured_to_proto(s.structured_output))
    return m


def stopping_from_proto(m: gen.StoppingParams) -> StoppingParams:
    return StoppingParams(
        max_new_tokens=m.max_new_tokens if m.HasField("max_new_tokens") else StoppingParams().max_new_tokens,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
    )


def stopping_to_proto(s: StoppingParams) -> gen.StoppingParams:
    return gen.StoppingParams(max_new_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)


def plan_to_proto(step: int, plan: StepPlan) -> wk.StepRequest:
    m = wk.StepRequest(
        step=step,
        dropped=plan.dropped,
        new=[wk.NewSequence(seq_id=n.seq_id, token_ids=n.token_ids, num_prompt_tokens=n.num_prompt_tokens,
                            sampling=sampling_to_proto(n.sampling), page_ids=n.page_ids,
                            num_computed_tokens=n.num_computed_tokens, traceparent=n.traceparent) for n in plan.new],
    )
    add = m.scheduled.add  # in place: a step has hundreds of chunks, most of them one decode token
    for c in plan.scheduled:
        if c.new_page_ids:
            add(seq_id=c.seq_id, num_tokens=c.num_tokens, new_page_ids=c.new_page_ids)
        else:
            add(seq_id=c.seq_id, num_tokens=c.num_tokens)
    return m


def plan_from_proto(m: wk.StepRequest) -> StepPlan:
    return StepPlan(
        dropped=list(m.dropped),
        new=[NewSequence(n.seq_id, list(n.token_ids), n.num_prompt_tokens, sampling_from_proto(n.sampling),
                         list(n.page_ids), n.num_computed_tokens, n.traceparent) for n in m.new],
        scheduled=[ScheduledChunk(c.seq_id, c.num_tokens, list(c.new_page_ids)) for c in m.scheduled],
    )


def result_to_proto(step: int, r: StepResult) -> wk.StepResult:
    m = wk.StepResult(step=step, forward_ms=r.forward_s * 1000, failed=list(r.failed),
                      failure_reasons=list(r.failed.values()), tier_stored=r.tier_stored, tier_evicted=r.tier_evicted,
                      spare_cores=r.spare_cores)
    add = m.tokens.add
    for t in r.tokens:
        if not t.top_ids and t.prompt is None:
            add(seq_id=t.seq_id, token_id=t.token_id, logprob=t.logprob)
        else:
            add(seq_id=t.seq_id, token_id=t.token_id, logprob=t.logprob, top_ids=t.top_ids,
                top_logprobs=t.top_logprobs, prompt=prompt_logprobs_to_proto(t.prompt))
    return m


def result_from_proto(m: wk.StepResult) -> StepResult:
    reasons = list(m.failure_reasons) + [""] * (len(m.failed) - len(m.failure_reasons))
    return StepResult([_sampled_from_proto(t) for t in m.tokens], m.forward_ms / 1000, dict(zip(m.failed, reasons)),
                      list(m.tier_stored), list(m.tier_evicted), m.spare_cores)


def _sampled_from_proto(t: wk.SampledToken) -> SampledToken:
    if not t.top_ids and not t.HasField("prompt"):
        return SampledToken(t.seq_id, t.token_id, t.logprob)
    prompt = PromptLogprobs(list(t.prompt.logprobs), list(t.prompt.top_ids), list(t.prompt.top_logprobs)) \
        if t.HasField("prompt") else None
    return SampledToken(t.seq_id, t.token_id, t.logprob, tuple(t.top_ids), tuple(t.top_logprobs), prompt)


def prompt_logprobs_to_proto(p: PromptLogprobs | None) -> wk.LogprobsOfPrompt | None:
    if p is None:
        return None
    return wk.LogprobsOfPrompt(logprobs=p.logprobs, top_ids=p.top_ids, top_logprobs=p.top_logprobs)


def retry_hint(seconds: float) -> tuple[tuple[str, str], ...]:
    """gRPC trailing metadata telling a caller refused for load or a limit when to try again:
    `retry-after` in whole seconds (as HTTP's header) and `retry-after-ms`."""
    return (("retry-after", str(max(1, math.ceil(seconds)))), ("retry-after-ms", str(int(seconds * 1000))))
