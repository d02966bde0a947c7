"""Speculative decoding: a drafter (drafting.py) guesses k tokens, one forward over the last token + the k
drafts (`Engine.few_rows`: the paired stack and head at S = k + 1, every row's logits) checks them all, and
the cache is rewound to the accepted rows (`KVCache.rewind`: the one cache rule; rejected rows stay in the
buffers past the length, never read, overwritten by the next writes). Each verification yields >= 1 token.

Acceptance (row i of the verification = the target's logits after the last token and drafts d_1..d_i):
- greedy (temperature 0): accept d_1..d_n while each equals row i-1's argmax, then row n's argmax. The tokens
  are those plain greedy decoding picks: where `Engine.exact_rows` holds (fused layers + stack, format 10) each
  verification row is bit for bit that token's decode step (export/fused.py: attention always runs >= 2 rows),
  fp32 and quantized alike; elsewhere (standard-op layers) up to float rounding, so a near-tie could break the
  other way, and the CLI's `auto` leaves speculation off there.
- sampling: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023) against p = softmax of
  `sampling.filtered` (the very distribution `sample` draws from, repetition penalty included with the drafts
  as history): accept d with probability min(1, p(d) / q(d)), else draw from norm(max(0, p - q)). The drafters
  here are deterministic (q a point mass on d), and for a point mass that rule is "draw x from p; accept d iff
  x = d, else emit x" (accepted with probability p(d); a rejection emits p without d). Drawn by `sample` itself,
  one uniform per emitted token in order, as plain sampling draws them: every emitted token is plain sampling's
  token for the same seed (bit for bit where the rows are, `Engine.exact_rows`; the lone-row stack of sampled runs
  is not, so its text drifts from plain sampling's, in distribution the same), whatever k was. A draft export
  draws its drafts from its own sampling distribution q (`DraftModel.propose_sampled`) and takes the general
  rule: the same distribution, not the same tokens.

How many tokens to draft (or none) is `draft_length.Adaptive`'s, from the drafts' accept rate and the measured
cost of a verification (`draft_length.Costs`).

Ring caches (sliding-window layers) cannot be rewound: speculation is off for them (`speculation_off`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from time import perf_counter

import numpy as np

from .draft_length import Adaptive, Costs
from .sampling import SamplingParams, apply_repetition_penalty, argmax_checked, filtered, sample, softmax

MODES = ("off", "lookup", "draft")


def accept_tokens(drafts: Sequence[int], token_at: Callable[[int], int]) -> tuple[int, int]:
    """(drafts accepted, the token after them): row i's token is `token_at(i)`, the one plain decoding picks there,
    and a draft is accepted iff it is that token. The one rule for greedy and for point-mass sampling."""
    for i, d in enumerate(drafts):
        t = token_at(i)
        if t != d:
            return i, t
    return len(drafts), token_at(len(drafts))


def accept_greedy(drafts: Sequence[int], rows: np.ndarray,
                  token: Callable[[np.ndarray], int] = argmax_checked) -> tuple[int, int]:
    """`accept_tokens` for verification logits rows [len(drafts) + 1, V]; `token`: a row's greedy id
    (`Columns.token` for rows in a head's column order)."""
    return accept_tokens(drafts, lambda i: token(rows[i]))


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probabilities p [V] (any positive total): the inverse CDF at u ~ U[0, 1)."""
    cdf = np.cumsum(p, dtype=np.float64)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, int(np.flatnonzero(p)[-1]))  # rounding at the top: the last token with mass


def target_probs(logits: np.ndarray, params: SamplingParams, history: np.ndarray) -> np.ndarray:
    """p [V] float64: the distribution `sampling.sample` draws from for these logits and previous ids."""
    x = apply_repetition_penalty(np.asarray(logits, np.float32), history, params.repetition_penalty)
    return softmax(filtered(x, params)).astype(np.float64)


def accept_sampled(drafts: Sequence[int], rows: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                   history: np.ndarray, q: np.ndarray | None = None,
                   vocab: Callable[[np.ndarray], np.ndarray] = lambda row: row) -> tuple[int, int]:
    """Speculative rejection sampling: (drafts accepted, the token after them). `history`: the ids before the
    verification's first row (the repetition penalty's), `q` [k, V]: the drafter's distributions, None for a
    deterministic drafter (a point mass on each draft: `accept_tokens` with each row's token drawn by `sample` as
    plain sampling draws it, one uniform of `rng` per emitted token). `vocab`: one row in vocabulary order
    (`Columns.vocab` for rows in a head's column order), applied only to the rows acceptance reads: a split head's
    9 rows cost 0.17 ms to reorder, and free-form text mostly stops at the first."""
    def seen(i: int) -> np.ndarray:  # the repetition penalty's ids before row i
        penalise = params.repetition_penalty != 1.0
        return np.concatenate([history, np.asarray(drafts[:i], np.int64)]) if penalise else history

    if q is None:
        return accept_tokens(drafts, lambda i: sample(vocab(rows[i]), params, rng, seen(i)))
    for i, d in enumerate(drafts):
        p = target_probs(vocab(rows[i]), params, seen(i))
        if rng.random() * q[i, d] < p[d]:   # u < p(d) / q(d), without dividing by a zero q
            continue
        r = np.maximum(p - q[i], 0.0)
        return i, draw(r if r.sum() > 0 else p, rng)
    return len(drafts), draw(target_probs(vocab(rows[len(drafts)]), params, seen(len(drafts))), rng)


class Stats:
    __slots__ = ("mode", "drafted", "accepted", "verifications")

    def __init__(self, mode: str) -> None:
        self.mode, self.drafted, self.accepted, self.verifications = mode, 0, 0, 0

    def to_dict(self) -> dict:
        return {"mode": self.mode, "drafted": self.drafted, "accepted": self.accepted,
                "verifications": self.verifications}


def configure(gen, speculative: str, draft, draft_tokens: int, config, timed: bool = True) -> None:
    """`Generator.speculate`: check the flags, open the draft export (its vocabulary and tokenizer file must be
    the target's) and set the generator's mode. `timed` False: k from the tokens alone (costs 1 + 0.1 k)."""
    from pathlib import Path

    from .errors import need

    need(speculative in MODES, f"speculative: expected one of {', '.join(MODES)}, got {speculative!r}")
    need(isinstance(draft_tokens, int) and 1 <= draft_tokens <= 32,
         f"draft_tokens: expected an integer in 1..32, got {draft_tokens!r}")
    need((speculative == "draft") == (draft is not None), "draft: needed by `speculative` 'draft', and only there")
    model = gen._draft  # an open draft export stays open across mode switches, until another replaces it
    if speculative == "draft" and not (model is not None and config is None and model.directory == Path(draft)):
        from .drafting import DraftModel  # opened first: a bad draft leaves the generator as it was
        from .fileio import safe_join

        tok = gen.manifest.tokenizer
        target = safe_join(gen.directory, tok["file"]) if tok is not None else None
        model = DraftModel(Path(draft), gen.manifest.vocab_size, config or gen.engine.config, target)
    # an engine opened with `SessionConfig.exact` None decoded through the lone-row stack: now the spare-row one
    reopened = speculative != "off" and gen.exact_engine()
    # costs measured so far stay valid while the engine and the drafter's cost stay: kept across "off" / "lookup"
    # switches (a benchmark alternating them, a chat toggling it) and for the same open draft export, measured
    # again when the drafter changes (a draft export's verifications include its steps)
    same_drafter = (speculative == "draft") == (gen.speculative == "draft") and model is gen._draft
    keep = timed and same_drafter and gen.costs is not None and not reopened
    if not keep:
        gen.costs = Costs() if timed else None
    gen.speculative, gen.draft_tokens, gen._draft = speculative, draft_tokens, model
    if speculative != "off":
        gen.engine.reserve_rows(draft_tokens + 1)  # the last token + k drafts: every verification's logits


# `rows_exact_here`: a prompt of PROBE_CONTEXT fixed ids, PROBE_STEPS greedy decode steps, then the same tokens as
# verifications of PROBE_ROWS. On qemu aarch64 (fp32, cortex-a72) the rows part from the fourth position on, at any k:
# 4 steps after a 1-token prompt saw nothing, 8 did (bench/arm64_rows.py)
PROBE_CONTEXT, PROBE_STEPS, PROBE_ROWS = 16, 8, 8


def rows_exact_here(engine) -> tuple[bool, float]:
    """(whether, max |difference|): on this machine's kernels, is each greedy decode step bit for bit that token's
    row of a verification? `Engine.exact_rows` says the graphs are built for it (x86: measured equal); another
    CPU's kernels may still compute one row and several differently (aarch64 under qemu, 2026-11-27: 3e-6 fp32,
    2e-4 int4 with an fp16 cache, 0.06 int8 on cortex-a76's dot-product kernels), and then greedy speculation could
    change the text at a near-tie. A check on one short stretch of context (~10 plain steps), not a proof for
    every length; the cache is rewound to where it was."""
    cache = engine.cache
    start = cache.length
    context = min(PROBE_CONTEXT, cache.free - PROBE_STEPS - 2)
    if not engine.exact_rows or context < 1:
        return False, float("inf")
    vocab = engine.manifest.vocab_size
    logits = engine.forward_columns([(7919 * (i + 1)) % vocab for i in range(context)]).copy()  # any ids
    fed, steps = [], []
    for _ in range(PROBE_STEPS):
        fed.append(engine.columns.token(logits))
        logits = engine.forward_columns(fed[-1:]).copy()
        steps.append(logits)
    cache.rewind(start + context)
    rows = np.concatenate([engine.few_columns(fed[i:i + PROBE_ROWS]).copy()
                           for i in range(0, PROBE_STEPS, PROBE_ROWS)])  # the same tokens as verifications
    cache.rewind(start)
    diff = float(np.abs(rows - np.stack(steps)).max())
    return diff == 0.0, diff


def speculation_off(cache) -> str | None:
    """Why speculation cannot run on this cache, or None."""
    return "sliding-window (ring) caches cannot be rewound" if any(cache.ring) else None


def speculative_tokens(gen, drafter, k_max: int, pick: Callable[[np.ndarray], int], logits: np.ndarray,
                       sampling: SamplingParams | None, rng: np.random.Generator, max_new: int,
                       stats: Stats) -> Iterator[int]:
    """The Generator's token source with speculation (its plain one is `Generator._plain_tokens`). Invariant
    at each yield: the token is picked, not fed; `gen.cache` holds rows [0, valid) of the context. The caller
    may stop at any yield (close()): the cache is then rewound to that token's `valid`. `sampling` None:
    greedy acceptance."""
    engine, cache, history = gen.engine, gen.cache, gen._history
    # sampling: untimed, the tokens alone choose k (measured costs kept across generations drafted less and lost
    # 3-15 % of the grounded gain for 0-3 % on free-form text: SmolLM2 int4 / fp32, T 0.7, 2026-11-27,
    # docs/benchmarks.md); the text does not depend on k either way
    adaptive = Adaptive(k_max, gen.costs if sampling is None else None)
    # a draft export draws its drafts when sampling: q [k, V] beside them, accepted with probability sum(min(p, q))
    # instead of a point mass's p(d) (SmolLM2-135M fp32, its int4 small export drafting, T 0.8, top-k 40, top-p
    # 0.95: 1.14-1.27x plain on five tasks, point-mass drafts 0.89-1.12x; k from measured costs 0.82-0.97x)
    draws = sampling is not None and drafter.draws
    drafter.reset(history[:cache.length].tolist())
    valid = cache.length
    emitted = 0
    token = pick(logits)
    try:
        while True:
            drafter.extend((token,))
            valid = cache.length
            emitted += 1
            yield token
            # the token is fed with up to k drafts; the verification must leave >= 1 free row (see Generator)
            room = min(cache.free - 2, max_new - emitted - 1)
            k = min(adaptive.budget(), room) if room > 0 else 0
            if k > 0:
                drafter.sync()  # a draft export's catch-up after a pause: paid, not counted as drafting's cost
            t0 = perf_counter()  # a verification's cost includes drafting (a draft export's k steps)
            start = cache.length
            q = None  # the drafts' distributions, where the drafter draws them (a draft export, sampling)
            if k > 0 and draws:
                drafts, q = drafter.propose_sampled(k, sampling, rng, np.append(history[:start], token))
            else:
                drafts = drafter.propose(k) if k > 0 else []
            if not drafts:
                logits = engine.forward_columns((token,))
                history[start] = token
                gen._carry = []
                adaptive.timed_step(perf_counter() - t0)
                token = pick(logits)
                continue
            k = len(drafts)
            rows = engine.few_columns([token, *drafts])   # the head's column order (Engine.columns)
            history[start:start + k + 1] = (token, *drafts)
            gen._carry = []
            if sampling is None:
                n, after = accept_greedy(drafts, rows, engine.columns.token)
            else:
                n, after = accept_sampled(drafts, rows, sampling, rng, history[:start + 1], q,
                                          vocab=engine.columns.vocab)
            cache.rewind(start + 1 + n)  # rejected rows: past the length, never read
            adaptive.verified(k, n, perf_counter() - t0)
            stats.drafted += k
            stats.accepted += n
            stats.verifications += 1
            for j in range(n):
                drafter.extend((drafts[j],))
                valid = start + 1 + j
                emitted += 1
                yield drafts[j]
            token = after
    finally:  # the caller stopped at a token whose row (and later ones) may be in the cache already
        if cache.length > valid:
            cache.rewind(valid)
