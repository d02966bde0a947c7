"""Next-token sampling: small pure functions on one logits vector [V].

`sample` applies, in the order Hugging Face `generate` uses, so that a diff against it compares like
with like:

    repetition penalty -> (temperature 0: argmax) -> temperature -> top-k -> top-p -> min-p -> draw

Each filter returns a new float32 vector with the dropped tokens set to -inf (or the input itself when the
filter is off); none writes to its input. The hot path runs once per generated token on the board with V up
to ~152k, so every step is O(V) passes (np.partition, compares): a full O(V log V) sort happens only in top-p
when the probability mass is spread so thin that the partial search below gives up.

Ties are broken towards the lower token id everywhere (greedy, top-k, top-p), so a filter keeps a defined
set of tokens, not whichever one `argpartition` happened to pick.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from .errors import EdgeError, need

# top-p first looks at this many candidates, then 4x more each round until the mass reaches p.
_TOP_P_FIRST = 64
# _draw's CDF is cut into blocks of this many tokens.
_DRAW_BLOCK = 1024


def _is_number(x: object) -> bool:
    """A finite real (numpy scalars too), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one token is picked from logits. Every default means "off" (plain softmax sampling)."""

    temperature: float = 1.0         # 0 => greedy (argmax)
    top_k: int = 0                   # 0 => off
    top_p: float = 1.0               # 1 => off
    min_p: float = 0.0               # 0 => off
    repetition_penalty: float = 1.0  # 1 => off

    def __post_init__(self) -> None:
        self.validate()
        for f in fields(self):  # numpy scalars -> plain int/float: the params end up in JSON
            object.__setattr__(self, f.name, (int if f.type == "int" else float)(getattr(self, f.name)))

    def validate(self) -> None:
        """Raise EdgeError naming the parameter when a value is out of range."""
        t, k, p, m, r = self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty
        need(_is_number(t) and t >= 0, f"temperature: expected a number >= 0 (0 = greedy), got {t!r}")
        need(_is_int(k) and k >= 0, f"top_k: expected an integer >= 0 (0 = off), got {k!r}")
        need(_is_number(p) and 0 < p <= 1, f"top_p: expected a number in (0, 1] (1 = off), got {p!r}")
        need(_is_number(m) and 0 <= m < 1, f"min_p: expected a number in [0, 1) (0 = off), got {m!r}")
        need(_is_number(r) and r > 0, f"repetition_penalty: expected a number > 0 (1 = off), got {r!r}")

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object], where: str) -> SamplingParams:
        """Build from a JSON object (the manifest's `sampler`); missing keys take the defaults."""
        need(isinstance(data, Mapping), f"{where}: expected an object of sampling settings")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        need(not unknown, f"{where}: unknown sampling setting(s) {unknown}; expected some of {sorted(known)}")
        try:
            return cls(**data)  # type: ignore[arg-type]
        except EdgeError as err:
            raise EdgeError(f"{where}: {err}") from None


@dataclass(frozen=True)
class StopParams:
    """How long one generation runs, where it stops early, and the seed of its random draws."""

    max_new_tokens: int = 256
    seed: int | None = None       # None => fresh OS entropy
    stop: tuple[str, ...] = ()    # stop strings, matched on the decoded text

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        n, s = self.max_new_tokens, self.seed
        need(_is_int(n) and n >= 0, f"max_new_tokens: expected an integer >= 0, got {n!r}")
        need(s is None or (_is_int(s) and s >= 0), f"seed: expected an integer >= 0, got {s!r}")
        need(isinstance(self.stop, tuple) and all(isinstance(x, str) and x for x in self.stop),
             f"stop: expected non-empty strings, got {self.stop!r}")

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


# ---------------------------------------------------------------------------------------------------------
# Filters: logits [V] -> logits [V] (float32, dropped tokens = -inf)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities [V] float32; -inf logits get exactly 0. exp in float32, the sum in float64."""
    x = np.asarray(logits, dtype=np.float32)
    e = np.exp(x - x.max())
    e /= e.sum(dtype=np.float64)
    return e


def greedy(logits: np.ndarray) -> int:
    """The argmax; the lowest id among equal maxima."""
    return int(np.argmax(logits))


def argmax_checked(logits: np.ndarray) -> int:
    """`sample` for temperature 0 without a penalty, in one pass instead of two (max, then argmax): argmax
    lands on the first NaN or +inf if there is one, so checking the picked value alone rejects the same
    logits `sample` rejects. The decode loop's and speculative verification's greedy pick."""
    token = int(np.argmax(logits))
    if not math.isfinite(logits[token]):  # not need(): its message would be formatted every step
        raise EdgeError(f"sample: logits must be finite with at least one > -inf, got {logits[token]} at "
                        f"token {token}")
    return token


def apply_repetition_penalty(logits: np.ndarray, previous_ids: Sequence[int] | np.ndarray,
                             penalty: float) -> np.ndarray:
    """CTRL / HF rule for each token already seen: positive logits / penalty, negative logits * penalty.

    A token seen many times is penalised once (gather, then scatter: duplicates write the same value).
    """
    x = np.asarray(logits, dtype=np.float32)
    ids = np.asarray(previous_ids, dtype=np.int64).reshape(-1)
    if penalty == 1.0 or ids.size == 0:
        return x
    need(int(ids.min()) >= 0 and int(ids.max()) < x.size,
         f"repetition penalty: previous token ids must be in [0, {x.size}), got {int(ids.min())}..{int(ids.max())}")
    seen = x[ids]
    out = x.copy()
    out[ids] = np.where(seen > 0, seen / np.float32(penalty), seen * np.float32(penalty))
    return out


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """(logits - max) / temperature.

    Shifting by the max first changes no probability and no filter decision, and keeps every value <= 0, so
    a tiny temperature sends the others to -inf instead of overflowing the max to +inf (inf - inf = NaN).
    """
    need(temperature > 0, f"temperature: expected > 0 here (0 means greedy), got {temperature!r}")
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max()
    # clamp to the float32 range: t -> inf would give -inf / inf = NaN, t -> 0 would give 0 / 0 = NaN.
    t = np.float32(min(temperature, float(np.finfo(np.float32).max)))
    if t == 0:  # below float32's smallest subnormal: the t -> 0+ limit keeps only the maxima
        return np.where(shifted == 0, np.float32(0), np.float32(-np.inf))
    with np.errstate(over="ignore"):  # overflow to -inf is the intended result for a tiny temperature
        return shifted / t


def _top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of x [V], ordered by value descending then index ascending.

    O(V) partition + O(k log k) sort; only k >= V costs a full sort.
    """
    n = x.size
    if k >= n:
        return np.argsort(-x, kind="stable")
    kth = np.partition(x, n - k)[n - k]     # the k-th largest value
    above = np.flatnonzero(x > kth)         # < k of them, all kept
    ties = np.flatnonzero(x == kth)[: k - above.size]  # fill up with the lowest ids at the k-th value
    idx = np.concatenate([above, ties])
    return idx[np.argsort(-x[idx], kind="stable")]


def _survivors(x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """(ids [n], values [n]) of the entries > -inf; (None, x) when nothing was dropped (the common case).

    None instead of arange(V): every fresh V-sized temporary costs page faults, more than the arithmetic.
    """
    if not (x == -np.inf).any():
        return None, x
    ids = np.flatnonzero(x != -np.inf)
    return ids, x[ids]


def _keep(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    out = np.full_like(x, -np.inf)
    out[idx] = x[idx]
    return out


def apply_top_k(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Keep exactly the k highest logits (0 => off)."""
    x = np.asarray(logits, dtype=np.float32)
    if top_k <= 0 or top_k >= x.size:
        return x
    return _keep(x, _top_indices(x, top_k))


def apply_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus: keep the fewest highest-probability tokens whose probabilities sum to >= top_p (>= 1 token).

    Works on the surviving tokens only (k of them after top-k), and looks at the best 64 first, then 4x
    more per round: a peaked distribution never sorts the vocabulary.
    """
    x = np.asarray(logits, dtype=np.float32)
    if top_p >= 1.0:
        return x
    live, z = _survivors(x)                            # [n] ids still in the running, their logits
    e = np.exp(z - z.max())                            # unnormalised probabilities [n] float32
    target = top_p * float(e.sum(dtype=np.float64))
    k = min(_TOP_P_FIRST, z.size)
    while True:
        idx = _top_indices(z, k)
        cum = np.cumsum(e[idx], dtype=np.float64)      # [k], best first
        if cum[-1] >= target or k >= z.size:
            keep = min(int(np.searchsorted(cum, target, side="left")) + 1, k)
            return _keep(x, idx[:keep] if live is None else live[idx[:keep]])
        k = min(4 * k, z.size)


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keep tokens with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p) (0 => off)."""
    x = np.asarray(logits, dtype=np.float32)
    if min_p <= 0.0:
        return x
    return np.where(x - x.max() >= np.float32(math.log(min_p)), x, np.float32(-np.inf))


# ---------------------------------------------------------------------------------------------------------


def _draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from softmax(logits): invert the CDF of the surviving tokens at u ~ U[0, 1).

    A float64 cumsum over 152k tokens is the slowest step of plain sampling, so the CDF is two-level:
    per-block sums find the block, one block's cumsum finds the token.
    """
    live, z = _survivors(logits)                       # [n] ids with p > 0 (k of them after top-k)
    e = np.exp(z - z.max())                            # [n] float32, unnormalised
    starts = np.arange(0, e.size, _DRAW_BLOCK)
    block_cdf = np.cumsum(np.add.reduceat(e, starts, dtype=np.float64))
    t = rng.random() * block_cdf[-1]
    b = _invert(block_cdf, t)
    t -= block_cdf[b - 1] if b > 0 else 0.0
    cdf = np.cumsum(e[starts[b]:starts[b] + _DRAW_BLOCK], dtype=np.float64)
    i = int(starts[b]) + _invert(cdf, t)
    return i if live is None else int(live[i])


def _invert(cdf: np.ndarray, t: float) -> int:
    """The first i with cdf[i] > t; rounding can push t to the total, then the last i with mass."""
    i = int(np.searchsorted(cdf, t, side="right"))
    return i if i < cdf.size else int(np.searchsorted(cdf, cdf[-1], side="left"))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           previous_ids: Sequence[int] | np.ndarray = ()) -> int:
    """The next token id for logits [V] (float; the last position's row of the head's output)."""
    x = np.asarray(logits, dtype=np.float32)
    need(x.ndim == 1 and x.size > 0, f"sample: expected logits of shape [V], got {x.shape}")
    top = float(x.max())  # max propagates NaN: this one check covers NaN, +inf and all -inf
    need(math.isfinite(top), f"sample: logits must be finite with at least one > -inf, max is {top}")
    x = apply_repetition_penalty(x, previous_ids, params.repetition_penalty)
    if params.temperature == 0:
        return greedy(x)
    return _draw(filtered(x, params), rng)


def filtered(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The logits `sample` draws from (temperature > 0, after the repetition penalty): temperature -> top-k ->
    top-p -> min-p, dropped tokens -inf. softmax() of it is the sampling distribution (speculative sampling
    accepts against exactly this one)."""
    x = apply_temperature(logits, params.temperature)
    x = apply_top_k(x, params.top_k)
    x = apply_top_p(x, params.top_p)
    return apply_min_p(x, params.min_p)
