"""`Transcript`: one generation's picked tokens as they become text, and why the generation ended.

The Generator (runtime/generator.py) computes the tokens, plainly or speculatively; this turns each into its text
delta (whole characters, `IncrementalDecoder`), holds back what may be the start of a stop string (`StopMatcher`)
and names the reason to stop: "eos" (an end-of-sequence id, never part of the tokens or the text), "stop" (a stop
string; its tokens are kept, its text is not), "max_new_tokens", or "length" (the static context is full: the last
token picked has no cache row left to be fed to).
"""

from __future__ import annotations

from .sampling import StopParams
from .stopping import StopMatcher
from .tokenizer import IncrementalDecoder, Tokenizer


class Transcript:
    """The tokens and text of one generation so far, and `reason`: why it ends ("" while it goes on)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: StopParams, eos: frozenset[int], room: int) -> None:
        """`tokenizer` None: ids only (no text). `room`: the new tokens the context can still feed, the last one
        picked past it ending the generation with "length"."""
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        # a model may have more rows than its tokenizer has tokens (padded vocabularies): those ids have no text
        self.known = tokenizer.vocab_size if tokenizer is not None else 0
        self.matcher = StopMatcher(stop.stop)
        self.max_new, self.eos, self.room = stop.max_new_tokens, eos, room
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.reason = "max_new_tokens"

    def push(self, token: int) -> str | None:
        """The text `token` adds (held back while it may start a stop string), or None for an EOS id."""
        if token in self.eos:
            self.reason = "eos"
            return None
        self.tokens.append(token)
        delta = self.decoder.push(token) if self.decoder is not None and token < self.known else ""
        if self.matcher.stops:
            delta = self.matcher.feed(delta)
        if self.matcher.stopped:
            self.reason = "stop"
        elif len(self.tokens) >= self.max_new:
            self.reason = "max_new_tokens"
        elif len(self.tokens) > self.room:
            self.reason = "length"
        else:
            self.reason = ""
        self.text.append(delta)
        return delta

    def tail(self) -> str:
        """The text held back at the end (a partial character, a stop string's possible start that none followed)."""
        tail = self.matcher.feed(self.decoder.flush()) + self.matcher.flush() if self.decoder is not None else ""
        if tail:
            self.text.append(tail)
        return tail

    @property
    def picked(self) -> int:
        """Tokens picked, an ending EOS included."""
        return len(self.tokens) + (self.reason == "eos")
