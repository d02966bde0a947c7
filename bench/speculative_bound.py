"""The most prompt lookup could gain on a case: how fast an oracle that knows the plain greedy tokens in advance
would decode them, drafting with the very drafter the runtime uses (PromptLookup) and paying what verifications
cost on this engine at the case's context (`measure_curve`: the engine's own calls, timed alternately with plain
steps). No policy that chooses k from the past can beat it, so `measured / bound` says how much of what
speculation could win the runtime's `Adaptive` wins, and `bound` alone says what the drafter and the kernels
allow (issue 26: SmolLM2-135M int4's grounded tasks).

A dynamic program over the tokens: at each point (tokens[:i] emitted, the last one picked, not fed) the oracle
takes a plain step (cost 1, one token) or verifies k drafts (cost curve[k], the accepted prefix + 1 tokens), k no
larger than the runtime would allow (`speculative_tokens`: at most max_new - emitted - 1).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from time import perf_counter

from edgellm.runtime.drafting import PromptLookup


def lookup_matches(prompt: Sequence[int], tokens: Sequence[int], k_max: int) -> list[tuple[int, int]]:
    """[i] -> (drafts proposed, drafts that tokens[i:] accepts) with tokens[:i] emitted, i = 1..len - 1: one
    PromptLookup fed as the runtime feeds it, asked for k_max drafts at every point (so the copy it resumes
    after a break is the last one proposed at any point, where the runtime's is the last one it drafted)."""
    drafter = PromptLookup()
    drafter.reset(list(prompt))
    drafter.extend(tokens[:1])
    out = [(0, 0)]  # i = 0: the prefill's token, never drafted for
    for i in range(1, len(tokens)):
        drafts = drafter.propose(min(k_max, len(tokens) - 1 - i))
        n = 0
        while n < len(drafts) and drafts[n] == tokens[i + n]:
            n += 1
        out.append((len(drafts), n))
        drafter.extend(tokens[i:i + 1])
    return out


def bound(prompt: Sequence[int], tokens: Sequence[int], curve: Sequence[float]) -> tuple[float, int]:
    """(the oracle's decode speed in plain steps per step of its own time, i.e. its ratio to plain decoding, and
    its verifications) for `tokens` generated after `prompt`; curve[k]: a verification of k drafts in plain
    steps (k = 0..k_max)."""
    end = len(tokens)
    if end < 2:
        return 1.0, 0  # nothing decoded after the prefill's token
    matches = lookup_matches(prompt, tokens, len(curve) - 1)
    cost = [float("inf")] * (end + 1)  # cost[i]: the cheapest way to have emitted tokens[:i]
    how = [0] * (end + 1)              # how[i]: verifications on that way
    cost[1] = 0.0                      # the prefill's token
    for i in range(1, end):
        if cost[i] + 1.0 < cost[i + 1]:
            cost[i + 1], how[i + 1] = cost[i] + 1.0, how[i]
        proposed, accepted = matches[i]
        for k in range(1, proposed + 1):  # k drafts of which min(k, accepted) pass, + the row after them
            j = min(end, i + min(k, accepted) + 1)
            c = cost[i] + curve[k]
            if c < cost[j]:
                cost[j], how[j] = c, how[i] + 1
    return (end - 1) / cost[end], how[end]  # plain decoding: one step per token after the prefill's


def measure_curve(gen, prompt: Sequence[int], k_max: int, calls: int = 7) -> list[float]:
    """[k] -> a verification of k drafts (`Engine.few_columns` over k + 1 rows) in plain steps (`forward_columns`
    of one token), k = 0..k_max, after `prompt`: medians of `calls` timings each, every verification timed right
    after a plain step. The generator's context is reset afterwards. Drafting and the acceptance test are not
    included (microseconds against milliseconds)."""
    engine, cache = gen.engine, gen.cache
    gen.reset()
    engine.reserve_rows(k_max + 1)
    engine.forward_columns(list(prompt))
    base = cache.length
    tokens = (list(prompt) * (k_max + 1))[-(k_max + 1):]  # k + 1 ids for any k, however short the prompt

    def timed(call, ids) -> float:
        start = perf_counter()
        call(ids)
        seconds = perf_counter() - start
        cache.rewind(base)
        return seconds

    for k in range(1, k_max + 1):  # each variant's first Run pays one-time costs: not measured
        timed(engine.few_columns, tokens[:k + 1])
    steps, rows = [], {k: [] for k in range(1, k_max + 1)}
    for _ in range(calls):
        for k in rows:
            steps.append(timed(engine.forward_columns, tokens[:1]))
            rows[k].append(timed(engine.few_columns, tokens[:k + 1]))
    step = statistics.median(steps)
    gen.reset()
    return [1.0] + [statistics.median(rows[k]) / step for k in range(1, k_max + 1)]
