"""Stop strings on streamed text: emit text as soon as it can no longer be the start of a stop string.

The generated text arrives in deltas (whole characters, from `IncrementalDecoder`). A stop string may span
several deltas, so the matcher holds back the longest tail of the pending text that is a prefix of some stop
string; once a stop string appears, the text before it is the last text emitted and generation stops (the
stop string itself is not part of the output).
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add a text delta; return the text now safe to emit ("" once stopped)."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[: min(hits)]
        keep = self._held(text)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text at the end of generation (no stop string followed it)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
