"""The sampler against transformers' logits processors and OpenAI's penalty definition, and its draws.

Filters are compared with transformers on the same logits (which tokens survive, and their
values); draws are checked for reproducibility per (seed, output position) and, over many
positions, for following softmax(logits / T) after the filters.
"""

from collections import Counter

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvmesh.params import SamplingParams
from kvmesh.services.worker.sampling import (
    SamplingRow,
    _apply_penalties,
    _filter_rows,
    _filter_top_k_top_p,
    position_seed,
    sample,
)

VOCAB = 64


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def at_position(n: int) -> list[int]:
    """Output ids that put a row at output position n (their values matter only to penalties)."""
    return [0] * n


def row(output_position: int = 0, prompt: list[int] | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt or [0], at_position(output_position))


def assert_same_survivors(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Same tokens masked to -inf, and the same values on the tokens that survive."""
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    kept = ~torch.isinf(theirs)
    assert torch.equal(ours[kept], theirs[kept])


# -- penalties -------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_over_prompt_and_output(penalty):
    logits = random_logits(1)[0]
    prompt, output = [3, 7, 7, 12, 40], [12, 5, 63, 5, 0]
    ours = _apply_penalties(logits.clone(), SamplingParams(repetition_penalty=penalty), prompt, output)
    history = torch.tensor([prompt + output])
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(history, logits[None].clone())[0]
    assert torch.equal(ours, theirs)
    untouched = [t for t in range(VOCAB) if t not in prompt + output]
    assert torch.equal(ours[untouched], logits[untouched])


def test_greedy_with_repetition_penalty_picks_the_argmax_of_the_transformers_processed_logits():
    logits = random_logits(6, seed=1)
    prompts = [[int(logits[i].argmax()), i, i + 9] for i in range(6)]  # each prompt repeats its favourite
    rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.8), prompts[i], []) for i in range(6)]
    chosen, _, _ = sample(logits, rows)
    for i, prompt in enumerate(prompts):
        processed = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([prompt]), logits[i : i + 1].clone())[0]
        assert chosen[i] == int(processed.argmax())


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.4), (-1.0, 2.0)])
def test_presence_and_frequency_penalties_follow_openai_over_output_tokens_only(presence, frequency):
    logits = random_logits(1, seed=2)[0]
    prompt, output = [1, 2, 2, 30], [30, 4, 4, 4, 9, 30]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = _apply_penalties(logits.clone(), params, prompt, output)
    expected = logits.clone()
    for token, count in Counter(output).items():
        expected[token] -= frequency * count + presence * (count > 0)
    torch.testing.assert_close(ours, expected)
    assert torch.equal(ours[[1, 2]], logits[[1, 2]])  # prompt-only tokens are not penalized


def test_presence_and_frequency_penalties_change_nothing_before_the_first_output_token():
    logits = random_logits(1, seed=3)[0]
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    assert torch.equal(_apply_penalties(logits.clone(), params, [1, 2, 3], []), logits)


def test_sample_leaves_the_callers_logits_unchanged():
    logits = random_logits(3, seed=4)
    before = logits.clone()
    rows = [
        row(prompt=[1, 2], temperature=0.0, repetition_penalty=1.5),
        row(3, temperature=0.8, top_k=5, top_p=0.9, presence_penalty=1.0, seed=1),
        row(temperature=0.0),
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


# -- top-k and top-p -------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 5, 17, VOCAB - 1, VOCAB, VOCAB + 10])
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_top_k_keeps_the_tokens_transformers_keeps(top_k, scale):
    logits = random_logits(8, seed=5, scale=scale)
    theirs = TopKLogitsWarper(top_k)(None, logits.clone())
    for i in range(8):
        assert_same_survivors(_filter_top_k_top_p(logits[i], top_k, 1.0), theirs[i])


@pytest.mark.parametrize("top_p", [1e-6, 0.1, 0.5, 0.8, 0.95, 0.999, 1.0])
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_top_p_keeps_the_tokens_transformers_keeps(top_p, scale):
    logits = random_logits(8, seed=6, scale=scale)
    theirs = TopPLogitsWarper(top_p)(None, logits.clone())  # keeps at least one token, like ours
    for i in range(8):
        ours = _filter_top_k_top_p(logits[i], 0, top_p)
        assert_same_survivors(ours, theirs[i])
        assert (~torch.isinf(ours)).sum() >= 1


@pytest.mark.parametrize("top_k, top_p", [(5, 0.5), (20, 0.9), (3, 0.999), (40, 0.2)])
def test_top_k_then_top_p_keeps_the_tokens_transformers_keeps(top_k, top_p):
    logits = random_logits(8, seed=7, scale=1.5)
    theirs = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits.clone()))
    for i in range(8):
        assert_same_survivors(_filter_top_k_top_p(logits[i], top_k, top_p), theirs[i])


# -- greedy and the reported logprob ---------------------------------------------------------


def test_greedy_picks_the_argmax_and_reports_its_raw_logprob():
    logits = random_logits(5, seed=8)
    chosen, logprobs, _ = sample(logits, [row(temperature=0.0) for _ in range(5)])
    assert chosen == logits.argmax(dim=-1).tolist()
    raw = torch.log_softmax(logits, dim=-1)
    assert logprobs == pytest.approx([float(raw[i, t]) for i, t in enumerate(chosen)], abs=1e-6)


def test_the_reported_logprob_is_the_raw_one_even_with_penalties_and_temperature():
    logits = random_logits(3, seed=9)
    favourite = int(logits[0].argmax())
    rows = [
        row(prompt=[favourite], temperature=0.0, repetition_penalty=50.0),  # penalized off its favourite
        row(4, temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
        row(11, temperature=0.5, top_k=4, seed=3),
    ]
    chosen, logprobs, _ = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert chosen[0] != favourite
    assert logprobs == pytest.approx([float(raw[i, t]) for i, t in enumerate(chosen)], abs=1e-6)
    processed = torch.log_softmax(_apply_penalties(logits[0].clone(), rows[0].params, [favourite], []), dim=-1)
    assert logprobs[0] != pytest.approx(float(processed[chosen[0]]), abs=1e-3)


@pytest.mark.parametrize("temperature", [1e-2, 1e-5, 1e-20])
def test_a_temperature_near_zero_behaves_like_greedy(temperature):
    spaced = torch.linspace(-3, 3, 32)  # top two always 0.19 apart
    gen = torch.Generator().manual_seed(10)
    logits = torch.stack([spaced[torch.randperm(32, generator=gen)] for _ in range(40)])
    chosen, _, _ = sample(logits, [row(i, temperature=temperature, seed=i) for i in range(40)])
    assert chosen == logits.argmax(dim=-1).tolist()


def test_a_temperature_too_small_for_float32_still_picks_the_argmax_instead_of_raising():
    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5]])
    chosen, _, _ = sample(logits, [row(temperature=1e-40, seed=1)])
    assert chosen == [0]


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (0, 1e-6)])
def test_keeping_a_single_token_is_greedy_at_any_temperature(top_k, top_p):
    logits = random_logits(16, seed=11)
    rows = [row(i, temperature=1.5, top_k=top_k, top_p=top_p, seed=100 + i) for i in range(16)]
    chosen, _, _ = sample(logits, rows)
    assert chosen == logits.argmax(dim=-1).tolist()


# -- seeded draws ----------------------------------------------------------------------------


def test_a_seeded_draw_depends_only_on_seed_and_position_not_on_the_rest_of_the_batch():
    flat = random_logits(1, seed=12, scale=0.5)
    others = random_logits(3, seed=13)
    alone, in_batch = [], []
    for position in range(50):
        target = row(position, temperature=1.0, seed=42)
        alone.append(sample(flat, [target])[0][0])
        batch = torch.cat([others[:2], flat, others[2:]])
        neighbours = [
            row(position + 3, temperature=0.0),
            row(7, prompt=[1, 2], temperature=0.9, repetition_penalty=1.2, seed=7),
            target,
            row(position, temperature=1.3, top_k=10, seed=43),
        ]
        in_batch.append(sample(batch, neighbours)[0][2])
    assert in_batch == alone
    assert len(set(alone)) > 10  # the draws really vary, so the comparison means something


def test_seeded_draws_are_reproducible():
    logits = random_logits(1, seed=14, scale=0.5).expand(30, VOCAB)
    rows = [row(i, temperature=1.0, seed=5) for i in range(30)]
    assert sample(logits, rows)[0] == sample(logits, rows)[0]


def test_a_fair_coin_comes_up_about_half_the_time_across_positions():
    coin = torch.zeros(400, 2)
    ones = sum(sample(coin, [row(i, temperature=1.0, seed=99) for i in range(400)])[0])
    assert 150 <= ones <= 250


def test_a_fair_coin_comes_up_about_half_the_time_across_seeds():
    coin = torch.zeros(400, 2)
    ones = sum(sample(coin, [row(0, temperature=1.0, seed=s) for s in range(400)])[0])
    assert 150 <= ones <= 250


def test_different_seeds_give_different_streams():
    coin = torch.zeros(64, 2)
    streams = {tuple(sample(coin, [row(i, temperature=1.0, seed=s) for i in range(64)])[0]) for s in range(5)}
    assert len(streams) == 5


def test_position_seeds_are_distinct_and_fit_in_63_bits():
    seeds = {position_seed(s, n) for s in range(100) for n in range(100)}
    assert len(seeds) == 100 * 100
    assert all(0 <= x < 2**63 for x in seeds)


# -- the sampled distribution ----------------------------------------------------------------

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
DRAWS = 2000


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.8, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.7), (0.7, 4, 0.9)],
)
def test_draws_follow_softmax_of_the_tempered_and_filtered_logits(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])
    # transformers' order: temperature, top-k, top-p
    processed = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if top_k:
        processed = TopKLogitsWarper(top_k)(None, processed)
    processed = TopPLogitsWarper(top_p)(None, processed)
    expected = processed[0].softmax(dim=-1) * DRAWS

    rows = [row(i, temperature=temperature, top_k=top_k, top_p=top_p, seed=1234) for i in range(DRAWS)]
    chosen, _, _ = sample(logits.expand(DRAWS, -1).contiguous(), rows)
    observed = torch.bincount(torch.tensor(chosen), minlength=6).double()

    possible = expected > 0
    assert observed[~possible].sum() == 0  # filtered tokens are never drawn
    e, o = expected[possible].double(), observed[possible]
    chi2 = float(((o - e) ** 2 / e).sum())
    assert chi2 < CHI2_CRITICAL[int(possible.sum()) - 1], (observed.tolist(), expected.tolist())


# -- one row's failure stays its own ---------------------------------------------------------


def test_a_row_whose_probabilities_are_not_finite_fails_alone_and_the_others_are_drawn_as_alone():
    logits = random_logits(3, seed=12)
    seen = [int(t) for t in torch.topk(logits[1], 3).indices]  # positive logits: divided by the penalty
    rows = [row(5, temperature=0.9, seed=21),
            SamplingRow(SamplingParams(temperature=1.0, repetition_penalty=1e-45, seed=4), seen, []),  # the sampler does not validate
            row(temperature=0.0, presence_penalty=1.0)]
    chosen, logprobs, failures = sample(logits, rows)
    assert list(failures) == [1] and "probabilities are not finite" in failures[1]
    assert chosen[0] == sample(logits[0:1], rows[0:1])[0][0]
    assert chosen[2] == int(logits[2].argmax())


def test_a_row_with_non_finite_logits_fails_even_when_greedy():
    logits = random_logits(3, seed=13)
    logits[1, 7] = float("nan")
    chosen, _, failures = sample(logits, [row(temperature=0.0) for _ in range(3)])
    assert list(failures) == [1] and "logits" in failures[1]
    assert [chosen[0], chosen[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.99])
@pytest.mark.parametrize("scale", [4.0, 8.0])
def test_top_p_over_a_large_vocabulary_keeps_the_tokens_transformers_keeps(top_p, scale):
    # 32,000 tokens: rows whose nucleus lies among the likeliest 1,024 are cut without a full
    # sort (a trained model's peaked rows; scale 8 here), the others are sorted whole (scale 4
    # at top-p 0.99 spreads past 1,024 tokens). Both must keep what transformers keeps.
    logits = random_logits(6, vocab=32000, seed=15, scale=scale)
    theirs = TopPLogitsWarper(top_p)(None, logits.clone())
    ours = _filter_rows(logits.clone(), [0] * 6, [top_p] * 6)
    for i in range(6):
        assert_same_survivors(ours[i], theirs[i])
    assert _filter_rows(logits.clone(), [5] * 6, [top_p] * 6).isfinite().sum(dim=-1).le(5).all()  # top-k first
