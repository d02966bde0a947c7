"""Drafters for speculative decoding (runtime/speculative.py): cheap guesses of the next k tokens, which the
target model then checks in one forward over k + 1 rows.

- `PromptLookup`: no model. The last n tokens of the context (n = 6, 5, ... down to 2; 1 with min_ngram=1) are
  looked up among the earlier n-grams of the context, the longest match first; the tokens that followed its
  latest occurrence are the draft (copied on over themselves where the context ends in a loop). Text that
  quotes, corrects or extracts from its prompt repeats long runs of it, and those drafts are then accepted
  whole. Where such a copy broke (the text changed a word or a comma), the suffix is first looked for a few
  tokens on in the passage being copied, which is where the text mostly goes on. The index is a dict per n,
  updated as each token arrives: O(n) per token; a proposal O(1) plus the window's few comparisons.
- `DraftModel`: a smaller export with the same tokenizer, run greedily through its own Engine and cache;
  its cache is rewound (`KVCache.rewind`, the one cache rule) to the longest prefix the context still shares
  with what it was fed.
Greedy drafts are deterministic, a point mass (speculative.accept_sampled's q = None); in a sampled run a draft
export draws its drafts from its own sampling distribution and hands that q over (`DraftModel.propose_sampled`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import need
from .sampling import SamplingParams
from .speculative import draw, target_probs

# the longest suffix that occurred before picks where to copy from: 6 rather than 3 tokens tells apart the places a
# short phrase recurs (SmolLM2-135M code edit: 137 vs 120 tok/s fp32, 283 vs 254 int4; the other tasks within 3 %)
MAX_NGRAM = 6
# a 1-token match (",", "the") drafts what followed its latest occurrence, mostly wrong in free text: each such
# verification costs more than the token it wins (SmolLM2 chat tasks, bench/speculative.py)
MIN_NGRAM = 2
# after a break (the text inserts a comma, writes ", and" for "; ", drops a word) it mostly picks the copied passage
# up again a few tokens on: the suffix, down to its last token, is looked for there first (`PromptLookup.resume`)
# before anywhere else, where the latest occurrence of a short suffix (", the") is often another sentence's
RESUME_WINDOW = 4
# a draft export catches up on a few tokens (the last of a draft accepted whole and the token after it) in one S = n
# run of its stack, as a verification runs: through the prefill graph such a feed cost a padded chunk of 32 rows
SHORT_FEED = 8


class PromptLookup:
    """n-gram lookup over the context so far (prompt + generated tokens), resuming a copy where it broke."""

    draws = False  # its drafts are a point mass, sampled runs included

    def sync(self) -> None:
        """Nothing to catch up on: the index follows the context token by token."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, window: int = RESUME_WINDOW) -> None:
        need(1 <= min_ngram <= max_ngram, f"prompt lookup: expected 1 <= n-gram lengths, got {min_ngram}..{max_ngram}")
        need(window >= 0, f"prompt lookup: expected a resume window >= 0, got {window}")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window
        self.tokens: list[int] = []
        # index[n-1]: the n tokens ending just before position p -> p (the latest such p): what followed them
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram)]
        self.source: int | None = None  # where the copy in progress reads: tokens[source] is the one it expects next

    def reset(self, tokens: Sequence[int]) -> None:
        """Start over from this context."""
        self.tokens = []
        self.index = [{} for _ in range(self.max_ngram)]
        self.source = None
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append context tokens (in order), indexing the n-grams that end just before each; a token the copy in
        progress expected moves its source on."""
        ctx, index = self.tokens, self.index
        for t in tokens:
            p = len(ctx)
            for n in range(1, min(self.max_ngram, p) + 1):
                index[n - 1][tuple(ctx[p - n:p])] = p
            if self.source is not None and self.source < p and ctx[self.source] == t:
                self.source += 1
            ctx.append(int(t))

    def propose(self, k: int) -> list[int]:
        """k tokens copied from where the context's suffix matches ([] when nothing matches; fewer when the copy
        reaches the context's end). Where: first near the copy in progress (`resume`), else after the latest
        earlier occurrence of the longest suffix of min_ngram..max_ngram tokens. Where the matched suffix spans a
        whole period (the distance between the two occurrences), the text is a loop and the copy runs on over
        what it copies (LZ77's overlapping copy): "x A B A B" drafts "A B A B ..." rather than stopping after
        "A B" (on a random-weight stories110M int4 export, whose greedy text cycles: 3.7 drafted tokens per
        verification instead of 1.4, decode +20 %). Not where only part of a period repeated ("A B x A B"):
        extending those too drafted more, and SmolLM2 int4's free-form tips ran at 0.95x plain in that one run."""
        found = self.resume() or self.latest()
        if found is None:
            return []
        p, n = found
        self.source = p
        ctx = self.tokens
        out = ctx[p:p + k]
        period = len(ctx) - p  # >= 1: a suffix is indexed only once a token follows it
        if n >= period:  # the last `period` tokens repeat the ones before them: a loop, copied on
            while len(out) < k:
                out.append(out[len(out) - period])
        return out

    def latest(self) -> tuple[int, int] | None:
        """(p, n): the longest suffix of min_ngram..max_ngram tokens that occurred before, last followed by
        tokens[p]; None when none did."""
        ctx = self.tokens
        for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
            p = self.index[n - 1].get(tuple(ctx[-n:]))
            if p is not None:
                return p, n
        return None

    def resume(self) -> tuple[int, int] | None:
        """(p, n): the longest suffix (down to one token) that also ends among the `window` + 1 tokens around
        the copy in progress's source (from the token before it), nearest first, followed there by tokens[p];
        None without a copy in progress or such a match. In sync this is the copy going on; after a break, the
        place a few tokens on where the text picks the copied passage up again."""
        if self.source is None or self.window == 0:
            return None
        ctx = self.tokens
        for n in range(min(self.max_ngram, len(ctx) - 1), 0, -1):
            suffix = ctx[-n:]
            # an occurrence ending at e < len - n: before the suffix itself, so a token follows it
            for e in range(max(self.source - 1, n - 1), min(self.source + self.window, len(ctx) - n)):
                if ctx[e - n + 1:e + 1] == suffix:
                    return e + 1, n
        return None


class DraftModel:
    """A smaller export run as the drafter: `propose` feeds it the context it has not seen yet (its cache first
    rewound to the prefix it shares with the context) and decodes k tokens greedily; `propose_sampled` draws them
    from its own sampling distribution, for a sampled run's rejection sampling."""

    draws = True  # sampled runs call propose_sampled (PromptLookup's drafts are a point mass)

    def __init__(self, directory: Path, target_vocab: int, config, target_tokenizer: Path | None) -> None:
        from .generator import Generator  # the draft is opened like any export (sha256 checked)

        # its own rows need match nothing, only be fast: the lone-row stack (no spare attention row) where it has one
        self.gen = Generator.open(directory, config=dataclasses.replace(config, exact=False))
        self.directory = Path(directory)
        m = self.gen.manifest
        need(m.vocab_size == target_vocab,
             f"--draft {directory}: vocabulary of {m.vocab_size} tokens, the target has {target_vocab}: a draft "
             "export must share the target's tokenizer")
        need(target_tokenizer is None or m.tokenizer is None or self._same_tokenizer(directory, target_tokenizer),
             f"--draft {directory}: its tokenizer differs from the target's (they must be the same tokenizer)")
        need(not any(self.gen.cache.ring), f"--draft {directory}: a model with sliding-window (ring) caches "
                                           "cannot be rewound, so it cannot draft")
        self.engine, self.cache = self.gen.engine, self.gen.cache
        self.tokens: list[int] = []   # the context
        self.fed = np.zeros(m.max_seq, np.int64)  # ids in the draft cache's rows

    def _same_tokenizer(self, directory: Path, target: Path) -> bool:
        """The same tokenizer content (a tokenizer.json.xz of format 11 equals the tokenizer.json it packs)."""
        from .fileio import safe_join
        from .tokenizer_hf import read_json_bytes

        return read_json_bytes(safe_join(directory, self.gen.manifest.tokenizer["file"])) == read_json_bytes(target)

    def reset(self, tokens: Sequence[int]) -> None:
        """A new context, fed to the draft cache now (from the prefix it shares with the last one): its prefill is
        the prompt's, not the first verification's, whose measured cost would otherwise make drafting look dear."""
        self.tokens = [int(t) for t in tokens]
        if 0 < len(self.tokens) < self.cache.max_seq:
            self._feed(len(self.tokens))

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def sync(self) -> None:
        """Feed what the draft cache missed while drafting paused (all of the context but its last token, which
        `propose` feeds): called before a verification's timer starts, so catching up on a pause is not measured
        as the cost of drafting k tokens (it made every probe after a pause look dear, and drafting paused again:
        SmolLM2-135M fp32 with its int4 small export drafting, free-form text 0.83-0.86x plain)."""
        end = len(self.tokens) - 1
        if end - self.cache.length > 1 and end < self.cache.max_seq:
            self._feed(end)

    def _feed(self, end: int) -> np.ndarray:
        """The draft cache rewound to the prefix it shares with context[:end] (the last token always fed again:
        its logits start a draft) and the rest fed; returns the last row's logits in the head's column order."""
        ctx, cache = self.tokens, self.cache
        n = min(cache.length, end - 1)
        same = np.flatnonzero(self.fed[:n] != np.asarray(ctx[:n], np.int64))
        keep = int(same[0]) if len(same) else n
        cache.rewind(keep)
        fresh = ctx[keep:end]
        if 1 < len(fresh) <= SHORT_FEED and self.engine.any_rows:
            logits = self.engine.few_columns(fresh)[-1]  # one S = n call, not a padded prefill chunk
        else:
            logits = self.engine.forward_columns(fresh)
        self.fed[keep:end] = fresh
        return logits

    def propose_sampled(self, k: int, params: SamplingParams, rng: np.random.Generator,
                        history: np.ndarray) -> tuple[list[int], np.ndarray | None]:
        """`propose` for a sampled run: each draft drawn from the draft's own sampling distribution q (the run's
        filters and repetition penalty over `history`, the ids before the first draft, and the drafts before it:
        `target_probs`), returned with q [k, V] for rejection sampling (speculative.accept_sampled), which then
        accepts a draft with probability sum(min(p, q)) instead of a point mass's p(d)."""
        q = np.empty((max(k, 0), self.gen.manifest.vocab_size), np.float64)
        vocab, penalise = self.engine.columns.vocab, params.repetition_penalty != 1.0

        def pick(logits: np.ndarray, out: list[int]) -> int:
            i = len(out)
            q[i] = target_probs(vocab(logits), params, np.append(history, out) if penalise and out else history)
            return draw(q[i], rng)

        out = self._decode(k, pick)
        return (out, q) if out else ([], None)

    def propose(self, k: int) -> list[int]:
        token = self.engine.columns.token  # the greedy id read off the head's columns, no reordering per step
        return self._decode(k, lambda logits, _out: token(logits))

    def _decode(self, k: int, pick) -> list[int]:
        """k drafts, each `pick(logits in the head's column order, the drafts so far)` after the context and the
        drafts before it ([] when k < 1 or they would not fit the draft cache)."""
        ctx, cache = self.tokens, self.cache
        if k <= 0 or len(ctx) + k > cache.max_seq:
            return []
        logits = self._feed(len(ctx))
        out: list[int] = []
        while True:
            out.append(pick(logits, out))
            if len(out) == k:
                return out
            self.fed[cache.length] = out[-1]
            logits = self.engine.forward_columns(out[-1:])
