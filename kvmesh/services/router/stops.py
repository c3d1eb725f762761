"""Stop strings over a stream of text deltas.

Text that might be the start of a stop string is held back until it either completes the stop
string (the stream ends just before it) or stops matching (it is released), so a client never
sees part of a stop string, even one spread over several tokens.
"""

from __future__ import annotations


class StopStringMatcher:
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
