"""One request's output on its way to the client: token ids in, tokens with text out.

`TokenRelay` owns everything the stream has produced so far: the token ids and logprobs (what a
resubmit after a scheduler's or worker's death sends, so the request continues after them), the
incremental detokenizer and the stop-string matcher. A resumed stream (the client reconnected
with `resume_from`) replays the tokens the client already has through the same detokenizer and
matcher without sending them, so the text continues exactly where the broken stream left it.
"""

from __future__ import annotations

from kvmesh.services.router.stops import StopStringMatcher
from kvmesh.tokenizer import IncrementalDetokenizer, Tokenizer
from kvmesh.v1 import generation_pb2 as gen


class TokenRelay:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stops: list[str], skip: int = 0):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = StopStringMatcher(stops)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.skip = skip  # tokens the client already received: replayed, not sent

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def push(self, token_id: int, logprob: float) -> gen.Token | None:
        """The token to send the client (its text may be "" while held back); None while replaying."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        text = self.stops.push(self.detok.push(token_id))
        if len(self.token_ids) <= self.skip:
            return None
        return gen.Token(id=token_id, text=text, logprob=logprob)

    def flush(self) -> str:
        """The text still held back, once the stream ends for a reason other than a stop string."""
        return self.stops.push(self.detok.flush()) + self.stops.flush()
