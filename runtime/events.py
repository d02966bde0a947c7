"""What `Generator.generate` yields: a `TokenEvent` per new token, then one `Result`."""

from __future__ import annotations

from dataclasses import dataclass

from .stats import Timings

FINISH_REASONS = ("eos", "stop", "length", "max_new_tokens")


class TokenEvent:
    """One new token and the text it completes ("" while a character or a possible stop string is still
    partial). `token_id` is None for the text flushed at the very end. (A slotted class, not a frozen
    dataclass: one is made per token, and the frozen __init__ costs microseconds.)"""

    __slots__ = ("token_id", "text")

    def __init__(self, token_id: int | None, text: str) -> None:
        self.token_id, self.text = token_id, text

    def __repr__(self) -> str:
        return f"TokenEvent(token_id={self.token_id!r}, text={self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenEvent) and (self.token_id, self.text) == (other.token_id, other.text)


@dataclass(frozen=True)
class Result:
    token_ids: list[int]          # the new tokens (no EOS)
    text: str                     # the streamed text, concatenated ("" without a tokenizer)
    finish_reason: str            # one of FINISH_REASONS
    prompt_ids: list[int]         # what was fed this call (after BOS / truncation / a carried-over token)
    timings: Timings
    peak_rss_mb: float
    speculative: dict | None = None  # Stats.to_dict(): mode, drafted, accepted, verifications (None: off)

    def to_dict(self) -> dict:
        spec = {"speculative": self.speculative} if self.speculative is not None else {}
        return {"text": self.text, "token_ids": list(self.token_ids), "finish_reason": self.finish_reason,
                "stats": {**self.timings.to_dict(), "peak_rss_mb": round(self.peak_rss_mb, 1), **spec}}
