"""Request validation (kvmesh.params): one rule, one message naming the field and the limit."""

import math

import pytest

from kvmesh.params import (
    MAX_REQUEST_ID_CHARS,
    InvalidRequest,
    SamplingParams,
    StoppingParams,
    validate_request,
    validate_request_id,
    validate_sampling,
)


@pytest.mark.parametrize("params, field, limit", [
    (dict(temperature=math.nan), "temperature", "[0, 100]"),
    (dict(temperature=math.inf), "temperature", "[0, 100]"),
    (dict(temperature=-0.5), "temperature", "[0, 100]"),
    (dict(temperature=101.0), "temperature", "[0, 100]"),
    (dict(top_p=math.nan), "top_p", "(0, 1]"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_k=-1), "top_k", ">= 0"),
    (dict(repetition_penalty=1e-45), "repetition_penalty", "[0.01, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "[0.01, 2]"),
    (dict(repetition_penalty=math.nan), "repetition_penalty", "[0.01, 2]"),
    (dict(repetition_penalty=math.inf), "repetition_penalty", "[0.01, 2]"),
    (dict(presence_penalty=math.nan), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-math.inf), "frequency_penalty", "[-2, 2]"),
    (dict(seed=2**63), "seed", "[0, 2^63)"),
])
def test_a_sampling_value_outside_its_limit_names_the_field_and_the_limit(params, field, limit):
    with pytest.raises(InvalidRequest) as err:
        validate_sampling(SamplingParams(**params))
    assert err.value.field == field and str(err.value).startswith(f"{field}: must be") and limit in str(err.value)


@pytest.mark.parametrize("params", [
    dict(temperature=0.0), dict(temperature=1e-5), dict(temperature=100.0), dict(repetition_penalty=0.01),
    dict(repetition_penalty=2.0), dict(top_p=1e-6, top_k=1), dict(presence_penalty=-2.0, frequency_penalty=2.0),
])
def test_values_at_the_limits_pass(params):
    validate_sampling(SamplingParams(**params))


def test_stop_token_ids_are_bounded_in_number_and_by_the_vocabulary():
    def check(stop_ids):
        validate_request([5], SamplingParams(), StoppingParams(stop_token_ids=tuple(stop_ids)), max_context=512, vocab_size=100)

    check(range(64))
    with pytest.raises(InvalidRequest, match=r"^stop_token_ids: has 65 ids, over the limit of 64$"):
        check(range(65))
    with pytest.raises(InvalidRequest, match=r"token id 100 is outside the vocabulary \[0, 100\)"):
        check([100])


def test_a_request_id_is_bounded_and_the_message_does_not_echo_it():
    validate_request_id("r" * MAX_REQUEST_ID_CHARS)
    with pytest.raises(InvalidRequest) as err:
        validate_request_id("r" * 1_000_000)
    assert str(err.value) == f"request_id: has 1000000 characters, over the limit of {MAX_REQUEST_ID_CHARS}"
