"""Choosing each sequence's next token from its logits.

Order: logit bias (OpenAI's `logit_bias`, added first), then as transformers applies them: repetition penalty, presence/frequency penalties,
temperature, top-k, top-p, then a draw. The draw for output position n of a request is the token
where its cumulative probability (in vocabulary order) passes a uniform number made from
(seed, n) alone, so the same request gives the same tokens alone, inside any batch, after
preemption and on another worker. Everything but the penalties and logit bias runs on the whole
batch at once: a per-row loop cost about 0.6 ms a row over a 32,000-token vocabulary, most of a
decode step at 128 sequences. The reported logprob is the chosen token's
log-probability under the model's raw distribution (before any processing), as vLLM reports it.
`top_logprobs` gives the likeliest tokens of a row under that same raw distribution.
A row that cannot be sampled (its logits or probabilities are not finite) fails alone; the others are drawn.
A row with a grammar (structured output) draws only among the tokens the grammar allows next: its
logits are masked (-inf) before the processing above, which cannot lift a forbidden token back
(-inf plus a bias is still -inf), and the grammar advances with the token accepted. The reported
logprobs stay the raw distribution's, unmasked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvmesh import grammar
from kvmesh.grammar import GrammarState
from kvmesh.kernels import native
from kvmesh.params import SamplingParams

_MASK64 = (1 << 64) - 1
# Top-p first looks for a row's nucleus among this many of its likeliest tokens, and sorts the
# whole row only when the nucleus is wider (sorting 32,000 logits costs about 1 ms a row).
NUCLEUS_CANDIDATES = 1024


def position_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit seed for one output position (splitmix64 of seed and position)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence: its parameters, its tokens and the output position."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: GrammarState | None = None  # structured output: where the sequence stands in its grammar
    # logit_bias as tensors, made once per sequence rather than once per draw.
    bias_ids: torch.Tensor | None = field(default=None, init=False, repr=False)
    bias_values: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.params.logit_bias:
            ids, values = zip(*self.params.logit_bias)
            self.bias_ids = torch.tensor(ids, dtype=torch.long)
            self.bias_values = torch.tensor(values, dtype=torch.float32)

    @property
    def processed(self) -> bool:
        """Whether its logits change before the draw beyond the grammar's mask (otherwise greedy is
        a plain argmax of the masked logits)."""
        return self.params.has_penalties or self.bias_ids is not None

    def accept(self, token_id: int) -> str | None:
        """Records the sampled token and advances the grammar; why not, when the grammar refuses it."""
        if self.grammar is not None and not self.grammar.accept(token_id):
            return f"structured_output: the grammar does not allow token {token_id}"
        self.output_ids.append(token_id)
        return None


def _apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row's logits with what top-k, then top-p, removes set to -inf (transformers' warpers)."""
    return _filter_rows(logits[None], [top_k], [top_p])[0]


def _filter_rows(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`logits` (`[rows, vocab]`) with what each row's top-k, then top-p, removes set to -inf: top-k
    keeps the tokens at least as likely as the k-th, top-p the likeliest tokens whose probability
    adds up to top_p (at least one), as transformers' TopKLogitsWarper and TopPLogitsWarper do."""
    vocab = logits.shape[1]
    by_k = [i for i, k in enumerate(top_k) if 0 < k < vocab]
    if by_k:
        ks = torch.tensor([top_k[i] for i in by_k])
        kth = torch.topk(logits[by_k], int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
        logits[by_k] = logits[by_k].masked_fill(logits[by_k] < kth, float("-inf"))
    by_p = [i for i, p in enumerate(top_p) if p < 1.0]
    if by_p:
        done = _top_p_among_likeliest(logits, by_p, [top_p[i] for i in by_p])
        by_p = [i for i in by_p if i not in done]
    if by_p:  # a nucleus wider than the candidates: the whole row sorted
        sorted_logits, order = torch.sort(logits[by_p], dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1 - torch.tensor([top_p[i] for i in by_p])[:, None]
        remove_sorted[:, -1] = False  # always keep the most likely token
        logits[by_p] = logits[by_p].masked_fill(remove_sorted.scatter(1, order, remove_sorted), float("-inf"))
    return logits


def _top_p_among_likeliest(logits: torch.Tensor, rows: list[int], top_p: list[float]) -> set[int]:
    """Applies top-p to those of `rows` whose nucleus lies among their NUCLEUS_CANDIDATES likeliest
    tokens (a trained model's distributions mostly do), without sorting the whole vocabulary;
    returns the rows it did. A token is kept while the likelier ones hold less than top_p."""
    if logits.shape[1] <= NUCLEUS_CANDIDATES:
        return set()
    values = torch.topk(logits[rows], NUCLEUS_CANDIDATES, dim=-1).values  # likeliest first
    peak = values[:, :1]
    # The cut falls where the mass passes top_p, which float32 sums misplace by about 1e-7: each
    # exp is within an ulp, and the sums are taken in float64.
    total = (logits[rows] - peak).exp_().sum(dim=-1, keepdim=True, dtype=torch.float64)
    probs = (values.double() - peak.double()).exp_() / total
    likelier = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, dtype=torch.float64)[:, None]
    fits = (likelier[:, -1:] >= p).flatten().tolist()  # the last candidate is out, so are all the others
    kept = (likelier < p).sum(dim=-1, keepdim=True)  # at least one: none is likelier than the first
    done = [j for j, ok in enumerate(fits) if ok]
    cut = [rows[j] for j in done]
    if cut:
        logits[cut] = logits[cut].masked_fill(logits[cut] < values.gather(1, kept - 1)[done], float("-inf"))
    return set(cut)


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and logsumexp: kvmesh's one-operator pick on the CPU
    (`kernels/csrc/fused_ops.cpp`; torch's argmax and log_softmax took four times as long), torch's
    operators elsewhere."""
    fused = native.fused_ops() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if fused is not None and logits.shape[1] > 0:
        return fused.greedy_pick(logits.contiguous())
    return logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[float], dict[int, str]]:
    """logits: `[len(rows), vocab]` float32. Returns the chosen ids, their raw logprobs (logit minus
    the row's logsumexp), and the rows that could not be sampled (row index -> why); a failed row's
    id and logprob mean nothing."""
    raw = logits
    argmax, logsumexp = greedy_pick(raw)
    failures: dict[int, str] = {}
    if any(r.grammar is not None for r in rows):
        # The grammar's mask is -inf on every token it forbids, so no logit_bias or penalty added
        # after it makes one of them drawable again.
        logits = _constrained(logits, rows, failures)
    if all(r.params.greedy and not r.processed and r.grammar is None for r in rows):
        chosen = argmax
    else:
        chosen = _choose(logits, rows, failures)
    picked = (raw.gather(1, chosen.unsqueeze(1)).squeeze(1) - logsumexp).tolist()
    for i, logprob in enumerate(picked):
        # Finite logits give every token a finite raw logprob: a NaN or inf here means the row's
        # logits are not finite (its forward pass overflowed), and its token, greedy or not, is noise.
        if not math.isfinite(logprob) and i not in failures:
            failures[i] = "the model's logits for it are not finite"
    return chosen.tolist(), picked, failures


def _choose(logits: torch.Tensor, rows: list[SamplingRow], failures: dict[int, str]) -> torch.Tensor:
    """Each row's token: its bias and penalties (on a copy of `logits`), then greedy rows take the
    argmax and the others are drawn (`_draw`); a row that fails gets 0."""
    if any(r.processed for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.processed:
                try:
                    _process_row(logits[i], r)
                except Exception as e:  # this row's values, not the batch: the others are still drawn
                    failures[i] = f"sampling failed: {e}"
    chosen = torch.zeros(len(rows), dtype=torch.long)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy and i not in failures]
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy and i not in failures]
    if greedy:
        chosen[greedy] = logits[greedy].argmax(dim=-1)
    if drawn:
        chosen[drawn], not_finite = _draw(logits if len(drawn) == len(rows) else logits[drawn], [rows[i] for i in drawn])
        for j in not_finite:
            p = rows[drawn[j]].params
            failures[drawn[j]] = (f"sampling failed: probabilities are not finite (temperature={p.temperature}, "
                                  f"repetition_penalty={p.repetition_penalty})")
            chosen[drawn[j]] = 0
    return chosen


def _process_row(logits: torch.Tensor, row: SamplingRow) -> None:
    """Adds the row's logit bias and applies its penalties, in place."""
    if row.bias_ids is not None:
        logits.index_add_(0, row.bias_ids, row.bias_values)
    if row.params.has_penalties:
        _apply_penalties(logits, row.params, row.prompt_ids, row.output_ids)  # in place


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, list[int]]:
    """One token per row of `logits` (`[rows, vocab]`) after temperature, top-k and top-p: the first
    whose cumulative probability passes the row's uniform number for (seed, output position).
    Also returns the rows whose probabilities are not finite (their tokens mean nothing)."""
    temperatures = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)[:, None]
    scaled = _filter_rows(logits / temperatures, [r.params.top_k for r in rows], [r.params.top_p for r in rows])
    uniforms = torch.tensor([uniform(r.params.seed or 0, len(r.output_ids)) for r in rows], dtype=scaled.dtype)
    fused = native.fused_ops() if scaled.device.type == "cpu" and scaled.dtype == torch.float32 else None
    if fused is not None and scaled.shape[1] > 0:  # the same walk in one C++ operator (fused_ops.cpp)
        ids, totals = fused.draw(scaled.contiguous(), uniforms)
        return ids, (~(torch.isfinite(totals) & (totals > 0))).nonzero().flatten().tolist()
    cdf = scaled.softmax(dim=-1).cumsum_(dim=-1)
    total = cdf[:, -1]
    # A row with a NaN or inf probability has a total that is not finite (probabilities are at most 1).
    not_finite = (~torch.isfinite(total)).nonzero().flatten().tolist()
    # Below the total, always: the token found then has a probability above zero.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return ids.clamp_(max=logits.shape[1] - 1), not_finite


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) for one output position of a seed: the top 24 bits of its position seed
    (exact in float32)."""
    return (position_seed(seed, position) >> 39) * 2.0**-24


def _constrained(logits: torch.Tensor, rows: list[SamplingRow], failures: dict[int, str]) -> torch.Tensor:
    """A copy of `logits` where each grammar row keeps only the tokens its grammar allows next; a row
    whose grammar fails, or allows nothing, goes into `failures`."""
    logits = logits.clone()
    bitmask = grammar.allocate_bitmask(len(rows), logits.shape[1])
    constrained = []
    for i, r in enumerate(rows):
        if r.grammar is None:
            continue
        try:
            r.grammar.fill(bitmask, i)
            constrained.append(i)
        except Exception as e:  # this row's grammar, not the batch
            failures[i] = f"structured_output: {e}"
    if constrained:
        grammar.apply_bitmask(logits, bitmask, constrained)
        allowed = torch.isfinite(logits[constrained]).any(dim=-1).tolist()
        for i, ok in zip(constrained, allowed):
            if not ok:
                failures.setdefault(i, "structured_output: the grammar allows no further token")
    return logits


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The `k` likeliest tokens of each row of `logprobs` (`[rows, vocab]`), best first: ids and logprobs."""
    if k <= 0 or logprobs.shape[0] == 0:
        return [[] for _ in range(logprobs.shape[0])], [[] for _ in range(logprobs.shape[0])]
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1)
    return ids.tolist(), values.tolist()
