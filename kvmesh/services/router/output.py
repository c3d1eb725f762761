"""The router's output layer: token ids from a scheduler become what a client reads.

One `ChoiceOutput` per completion turns its token ids into text (incremental detokenization, a
character split over tokens released with its last token) and holds back text that may be the
start of a stop string (`StopStringMatcher`), so a client never sees part of one, even one spread
over several tokens. `prompt_tokens` gives the prompt's tokens with their logprobs (echo), and the
`*_logprobs` functions render tokens in the OpenAI API's two logprobs shapes, each token with its
own raw bytes (`Tokenizer.token_bytes`), not the text it released.

A ChoiceOutput also remembers the token ids and logprobs streamed so far: a request whose
scheduler or worker died is resubmitted with them (as output tokens) and its tokens continue the
same ChoiceOutput, so the text a client has seen is never repeated. A client resuming a broken
stream (`resume_from`) gets `skip` tokens replayed through the detokenizer and the stop strings
without being sent, so the text continues exactly where the broken stream left it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.tokenizer import IncrementalDetokenizer, Tokenizer
from kvmesh.v1 import generation_pb2 as gen


class StopStringMatcher:
    """Stop strings over a stream of text deltas: text that might start a stop string is held until
    it completes one (the stream ends just before it) or stops matching (it is released)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Returns the text that is safe to show; sets `stopped` when a stop string completes."""
        if not self.stops:
            return delta
        buf = self.held + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held, self.stopped = "", True
            return buf[: min(hits)]
        keep = max((n for s in self.stops for n in range(1, min(len(s), len(buf) + 1)) if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held text, once the stream ends for another reason."""
        held, self.held = self.held, ""
        return held


class ChoiceOutput:
    """One completion's text as its tokens arrive: `token()` per token, `finish()` at the end.
    `token_ids`/`logprobs`: every token pushed so far; the first `skip` are replayed, not sent."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stops: list[str], skip: int = 0):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = StopStringMatcher(stops)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.skip = skip  # tokens the client already received (it resumed a broken stream)

    @property
    def stopped(self) -> bool:
        """A stop string completed: the completion ends here, whatever comes after."""
        return self.stops.stopped

    def token(self, token_id: int, logprob: float, top: Sequence[gen.TokenLogprob] = ()) -> gen.Token | None:
        """The token with the text it releases (often "", never part of a stop string); None for
        one of the first `skip`, which the client has already."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        text = self.stops.push(self.detokenizer.push(token_id))
        if len(self.token_ids) <= self.skip:
            return None
        return gen.Token(id=token_id, text=text, logprob=logprob, top_logprobs=top)

    def finish(self) -> str:
        """The text still held (a trailing split character, a partial stop string) when the
        completion ends for another reason than a stop string; "" after one."""
        if self.stops.stopped:
            return ""
        return self.stops.push(self.detokenizer.flush()) + self.stops.flush()


def send_now(held: int, sent: bool, interval: int, gap_s: float | None, max_gap_s: float) -> bool:
    """Whether a stream's `held` tokens go to its client now, under a stream interval: its first
    token at once, then once `interval` wait, or as soon as one came `max_gap_s` or more after the
    token before it (`gap_s`; 0 turns this off). Holding tokens saves per-message work only while
    they come fast; a stream whose steps are slow (a burst of prompts being computed) would wait
    `interval` slow steps for its text."""
    if not held:
        return False
    return not sent or held >= interval or (max_gap_s > 0 and gap_s is not None and gap_s >= max_gap_s)


def alternatives(top_ids: Sequence[int], top_logprobs: Sequence[float], k: int, i: int) -> list[gen.TokenLogprob]:
    """Position i's k alternatives from the flattened lists (k per position, best first)."""
    return [gen.TokenLogprob(id=t, logprob=lp) for t, lp in zip(top_ids[i * k : i * k + k], top_logprobs[i * k : i * k + k])]


def prompt_tokens(tokenizer: Tokenizer, prompt_ids: Sequence[int], scores, k: int) -> list[gen.Token]:
    """The prompt's tokens, each with the text it releases and, from the second on, its logprob
    and k alternatives from `scores` (a LogprobsOfPrompt for tokens 1..n-1)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    tokens = []
    for i, token_id in enumerate(prompt_ids):
        token = gen.Token(id=token_id, text=detokenizer.push(token_id))
        if i > 0 and i - 1 < len(scores.logprobs):
            token.logprob = scores.logprobs[i - 1]
            token.top_logprobs.extend(alternatives(scores.top_ids, scores.top_logprobs, k, i - 1))
        tokens.append(token)
    if tokens:
        tokens[-1].text += detokenizer.flush()
    return tokens


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's own text: its raw bytes as UTF-8, a byte of a split character as `\\xNN`."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="backslashreplace")


def completion_logprobs(tokenizer: Tokenizer, tokens: Sequence[gen.Token], offset: int, first_is_prompt: bool = False,
                        top: bool = False) -> dict:
    """/v1/completions' `logprobs`: `tokens` are the text each token released (they join to the
    text), `text_offset` counts from `offset`. With `first_is_prompt`, the first token is the
    prompt's first and has no logprob (null). `top`: the alternatives as {token text: logprob}."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    logprobs = [t.logprob for t in tokens]
    tops = [{token_text(tokenizer, a.id): a.logprob for a in t.top_logprobs} for t in tokens] if top else None
    if first_is_prompt and tokens:
        logprobs[0] = None
        if tops is not None:
            tops[0] = None
    return {"tokens": [t.text for t in tokens], "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, tokens: Sequence[gen.Token]) -> dict:
    """/v1/chat/completions' `logprobs`: one entry per token, with the token's own text and raw bytes."""
    def entry(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="backslashreplace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(a.id, a.logprob) for a in t.top_logprobs]}
                        for t in tokens]}
