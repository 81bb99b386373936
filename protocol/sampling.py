"""The one sampler every host follows, so that any answer can be checked token by token.

A host draws each token of an answer from its model's logits by the rule below and by no
other; a verifier that holds the same model recomputes the logits (one prefill pass over
prompt + answer) and asks of each delivered token whether the same draw selects it
(:func:`token_check`). Pure Python and NumPy (imported lazily): a host installs it without
the gateway.

**The draw.** ``u = uniform(seed, position)``: the SHA-256 digest of 16 bytes, ``seed mod
2**64`` then ``position``, each an unsigned 64-bit little-endian integer; the digest's first
8 bytes read as a little-endian unsigned integer; its top 53 bits divided by 2**53. So
0 <= u < 1. ``position`` is the token's absolute index in the context: the number of tokens
before it (the prompt's tokens plus the tokens generated so far). The job's ``seed`` is fixed
by the gateway (the customer's own when given).

**The distribution** at that position, from the model's logits ``l`` over the vocabulary (a
masked token, ``-inf``, has weight 0). A constraint masks tokens first: under structured
output (a ``response_format``'s grammar) every token the grammar refuses in its state after the
tokens generated so far; while a host re-writes text it resumes (a cut last word, a
``rewrite``) every token that neither starts with the text still to write nor is a prefix of it.
The draw is then made over the masked logits by the same rule (:func:`select_masked` makes it
asking the grammar about as few tokens as it can):

1. ``temperature <= 0`` is greedy: the token is the argmax of ``l``, the lowest id on a tie;
   ``u`` is not used.
2. Otherwise the weights are ``w_i = exp((l_i - max(l)) / temperature)``.
3. ``top_p < 1`` keeps the shortest prefix of the tokens ranked by weight (heaviest first,
   equal weights by lower id) whose weight reaches ``top_p`` times the total weight (at least
   one token); ``top_p >= 1`` keeps every token.
4. The kept tokens are taken **in ascending token id order**, with cumulative weights
   ``C_1 <= ... <= C_n = W``: the token is the first whose ``C_j > u * W``. Token ``j`` owns
   the interval ``[C_{j-1} / W, C_j / W)`` of ``u``.

Ascending id order, not probability order: two honest machines' logits differ in their last
digits (thread counts, batch sizes, CPU against GPU, quantised kernels), and in id order such
a difference moves each interval's edges only a little, where in probability order near-equal
tokens swap places and move whole intervals.

**A vocabulary in parts.** A host whose output head is split (a ring: its head stage holds
the first ids, its tail the rest) makes the same draw: each part reports its best logit and
its total weight relative to it (:func:`part_mass`); from those, :func:`part_of_draw` says
which part holds ``u * W`` and the draw to make within that part alone (its own ``u``), which
:func:`select` over that part's logits then makes. The token is the one :func:`select` over
the whole vocabulary gives, but for rounding. top_p < 1 is not drawn in parts: the nucleus is
cut over the whole vocabulary, so such a host gathers every part's logits and draws with
:func:`select`.

The rule is stated in exact arithmetic. This implementation takes the exponentials in float32
and sums them in float64 (blocks of ``BLOCK`` tokens, then within one block: no cumulative sum
over the whole vocabulary), which moves an edge by about 1e-7 of the mass at most; another
implementation may round otherwise. The verifier allows for both.

**The check.** An honest machine's logits are taken to differ from the verifier's by at most
``tie_gap / 2`` each, so every weight by a factor within ``exp(±tie_gap / (2 temperature))``.
Greedy: the token the verifier's own argmax selects is a ``match``; another whose logit is
within ``tie_gap`` of the best is ``uncertain`` (a near-tie an honest machine may break the
other way); any other is a ``miss``. Sampled: a token whose interval holds ``u`` is a ``match``;
one that holds it under some weights within those factors, give or take ``tolerance`` of the
mass, is ``uncertain`` (that covers a token at the edge of the top-p set too); any other is a
``miss``. ``TIE_GAP`` and ``TOLERANCE`` were chosen from measurements on the shipped model
(``bench/trust.py``): see their comments.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import numpy.typing as npt

MATCH, UNCERTAIN, MISS = "match", "uncertain", "miss"

# How far two honest machines' logits may differ, in a logit: the gap between the best two
# under which they may pick different greedy tokens, and twice the drift of any one weight's
# logit (each weight within exp(±TIE_GAP / (2 temperature)) of the verifier's, all moving the
# worst way at once). llama.cpp's one-token decode (a host) and its batched prefill (a
# verifier) differ on the shipped Gemma 3 270M by ~0.1 in a logit (median) and up to ~1
# (their kernels differ; threads do not matter). Measured with bench/trust.py and the same
# harness before it (4,500 honest tokens; T 0 to 1.5, top_p 1 and 0.9): the largest tie_gap
# any honest token needed not to miss was 0.30 (0.16 at the 99th percentile; greedy 0.21).
# Twice that leaves room for machines further apart (CPU against GPU) while every cheat
# measured still misses (junk on nearly every token, another seed on about half).
TIE_GAP = 0.6
# Mass by which an edge may move beyond what TIE_GAP explains: rounding, and another
# implementation's order of summation.
TOLERANCE = 1e-6

BLOCK = 512  # tokens per block when summing (Gemma 3's 262,144 are 512 blocks)
THRESHOLDS = (1e-4, 1e-8)  # weights (relative to the best, 1) above which the top-p set is sought first
SORT_AT_MOST = 2048  # tokens near the top-p cut sorted by weight (the heavier ones are kept unsorted)
LIKELY = (64, 1024, 16_384)  # under a mask: the likeliest tokens asked about first, before every token
SETTLED_BY = 1e-9  # under a mask: the mass by which a draw settled lazily must be clear of rounding


@dataclass(frozen=True)
class Check:
    """The verdict on one delivered token (MATCH, UNCERTAIN or MISS) and its margin: sampled,
    the mass between ``u`` and the token's interval (0 inside it; for a token outside the top-p
    set, the mass by which the tokens ranked before it exceed ``top_p``); greedy, the best
    logit minus the token's."""

    verdict: str
    margin: float


def uniform(seed: int, position: int) -> float:
    """The draw for the token at ``position`` (tokens before it in the context) of a job
    sampled with ``seed``: in [0, 1), a multiple of 2**-53 (see the module's docstring)."""
    if not 0 <= position < 2**64:
        raise ValueError(f"position {position} is not an unsigned 64-bit integer")
    digest = hashlib.sha256(struct.pack("<QQ", seed % 2**64, position)).digest()
    return (int.from_bytes(digest[:8], "little") >> 11) / 2**53


def select(logits: npt.ArrayLike, *, temperature: float, top_p: float, u: float) -> int:
    """The token the specified sampler draws from ``logits`` (one position's, over the
    vocabulary) with the draw ``u``."""
    import numpy as np

    scores = np.ascontiguousarray(logits, dtype=np.float32)  # llama-cpp-python passes a strided view
    if temperature <= 0:
        return int(np.argmax(scores))
    weights = _weights(scores, temperature)
    if top_p >= 1:
        return _Whole(weights).select(u)
    kept, cumulative = _kept(weights, top_p)
    return int(kept[_first_above(cumulative, _target(u, cumulative[-1]))])


def part_mass(logits: npt.ArrayLike, *, temperature: float) -> tuple[float, float]:
    """A part of the vocabulary's best logit and its tokens' total weight relative to it (the
    exponentials in float32, summed in float64, as :func:`select` weighs them): what a part
    tells the others so that the draw is made over the whole (temperature > 0)."""
    import numpy as np

    scores = np.ascontiguousarray(logits, dtype=np.float32)
    return float(scores.max()), float(_weights(scores, temperature).sum(dtype=np.float64))


def part_of_draw(parts: list[tuple[float, float]], *, temperature: float, u: float) -> tuple[int, float]:
    """Which of the vocabulary's `parts` (their :func:`part_mass`, in ascending id order) holds
    the draw ``u`` over the whole, and the draw within that part (a ``u`` for :func:`select`
    over its logits alone)."""
    best = max(top for top, _ in parts)
    totals = [total * math.exp((top - best) / temperature) for top, total in parts]  # each relative to the best
    target = _target(u, sum(totals))
    for index, total in enumerate(totals[:-1]):
        if target < total:
            return index, target / total
        target -= total
    last = totals[-1]  # (what rounding leaves past the other parts is the last part's)
    return len(totals) - 1, min(max(target / last, 0.0), math.nextafter(1.0, 0.0)) if last > 0 else 0.0


def select_masked(
    logits: npt.ArrayLike,
    allowed: Callable[[npt.NDArray[np.intp]], npt.NDArray[np.bool_]],
    *,
    temperature: float,
    top_p: float,
    u: float,
) -> int:
    """:func:`select` over ``logits`` with the tokens ``allowed`` refuses masked (``allowed``
    answers, for an array of ids, whether each may be drawn: a grammar in its current state).

    A grammar's answer costs far more a token than anything here (asking about all of Gemma 3's
    262,144 tokens takes llama.cpp about 0.1 s), so the likeliest tokens are asked about first
    (``LIKELY``, each round more) and the draw is settled among those it allows when no answer
    about the others could change it: greedy, when the best allowed token outranks every token
    not asked about; top_p 1, when the target ``u * W`` and the chosen interval stay apart
    whatever the others' answers (their whole weight could only widen ``W`` and shift the
    interval); top_p < 1, when the top-p cut falls on the same allowed token (heavier than any
    token not asked about) whatever the others' weight adds to ``W``. Otherwise every token is
    asked about and the draw is :func:`select`'s over the masked logits. Raises ValueError when
    ``allowed`` refuses every token with any weight."""
    import numpy as np

    scores = np.ascontiguousarray(logits, dtype=np.float32)
    weights = None if temperature <= 0 else _weights(scores, temperature)
    for count in (c for c in LIKELY if c < len(scores)):
        if weights is None:
            settled = _greedy_settled(scores, allowed, count)
        elif top_p >= 1:
            settled = _draw_settled(weights, allowed, count, u)
        else:
            settled = _top_p_settled(scores, weights, allowed, count, top_p=top_p, temperature=temperature, u=u)
        if settled is not None:
            return settled
    masked = np.where(allowed(np.arange(len(scores))), scores, np.float32(-np.inf))
    if not np.isfinite(masked.max()):
        raise ValueError("the mask refuses every token")
    return select(masked, temperature=temperature, top_p=top_p, u=u)


def _greedy_settled(
    scores: npt.NDArray[np.float32],
    allowed: Callable[[npt.NDArray[np.intp]], npt.NDArray[np.bool_]],
    count: int,
) -> int | None:
    """The best allowed token among the ``count`` best, when it outranks every other (None: it may not)."""
    import numpy as np

    part = np.argpartition(-scores, count)
    best, unseen = part[:count], float(scores[part[count]])  # every token not asked about scores at most `unseen`
    ranked = best[np.lexsort((best, -scores[best]))]  # best first, a tie by lower id
    ok = allowed(ranked)
    if not ok.any():
        return None
    token = int(ranked[int(np.argmax(ok))])
    return token if float(scores[token]) > unseen else None


def _draw_settled(
    weights: npt.NDArray[np.float32],
    allowed: Callable[[npt.NDArray[np.intp]], npt.NDArray[np.bool_]],
    count: int,
    u: float,
) -> int | None:
    """The draw (top_p 1) among the ``count`` heaviest tokens, when the weight of those not
    asked about (``unknown``, ``below`` of it at lower ids than the token) cannot move it."""
    import numpy as np

    asked = np.sort(np.argpartition(-weights, count)[:count])
    kept = asked[allowed(asked)]
    kept_weights = weights[kept].astype(np.float64)
    cumulative = np.cumsum(kept_weights)
    if not len(kept) or cumulative[-1] <= 0:
        return None
    known, total = float(cumulative[-1]), float(weights.sum(dtype=np.float64))
    unknown = max(total - float(weights[asked].sum(dtype=np.float64)), 0.0)
    target = _target(u, known)
    at = _first_above(cumulative, target)
    token, lo, hi = int(kept[at]), float(cumulative[at] - kept_weights[at]), float(cumulative[at])
    below = max(
        float(weights[:token].sum(dtype=np.float64)) - float(weights[asked[asked < token]].sum(dtype=np.float64)), 0.0
    )
    clear = SETTLED_BY * total
    return token if lo + below + clear <= target and u * (known + unknown) + clear < hi else None


def _top_p_settled(
    scores: npt.NDArray[np.float32],
    weights: npt.NDArray[np.float32],
    allowed: Callable[[npt.NDArray[np.intp]], npt.NDArray[np.bool_]],
    count: int,
    *,
    top_p: float,
    temperature: float,
    u: float,
) -> int | None:
    """The draw (top_p < 1) among the ``count`` heaviest tokens, when the top-p cut over the
    allowed ones ends at the same token (strictly heavier than any token not asked about) for
    any weight ``unknown`` of those not asked about (it only raises the goal ``top_p * W``).
    The kept tokens are then exactly :func:`_kept`'s over the masked logits, and so is the draw
    (their weights taken again from the best allowed logit, as :func:`select` takes them)."""
    import numpy as np

    part = np.argpartition(-weights, count)
    asked, unseen = part[:count], float(weights[part[count]])
    kept = asked[allowed(asked)]
    if not len(kept):
        return None
    kept_weights = weights[kept].astype(np.float64)
    order = np.lexsort((kept, -kept_weights))  # heaviest first, equal weights by lower id
    reached = np.cumsum(kept_weights[order])
    total = float(weights.sum(dtype=np.float64))
    unknown = max(total - float(weights[asked].sum(dtype=np.float64)), 0.0)
    known, clear = float(reached[-1]), SETTLED_BY * total
    end = int(np.searchsorted(reached, top_p * known, side="left"))
    if end != int(np.searchsorted(reached, top_p * (known + unknown) + clear, side="left")) or end >= len(kept):
        return None
    if float(kept_weights[order[end]]) <= unseen or (end and float(reached[end - 1]) + clear >= top_p * known):
        return None
    chosen = np.sort(kept[order[: end + 1]])
    own = _weights(scores[chosen], temperature)  # as select's: from the best allowed logit (among the chosen)
    cumulative = np.cumsum(own, dtype=np.float64)
    return int(chosen[_first_above(cumulative, _target(u, float(cumulative[-1])))])


def token_check(
    logits: npt.ArrayLike,
    token: int,
    *,
    temperature: float,
    top_p: float,
    u: float,
    tolerance: float = TOLERANCE,
    tie_gap: float = TIE_GAP,
) -> Check:
    """Whether ``token`` is what the specified sampler draws from ``logits`` with ``u``, given
    that an honest machine's logits differ from these (see the module's docstring)."""
    import numpy as np

    scores = np.ascontiguousarray(logits, dtype=np.float32)  # llama-cpp-python passes a strided view
    if temperature <= 0:
        best = int(np.argmax(scores))
        gap = float(scores[best]) - float(scores[token])
        verdict = MATCH if token == best else UNCERTAIN if gap < tie_gap else MISS
        return Check(verdict, gap)
    weights = _weights(scores, temperature)
    slack = math.exp(min(tie_gap / (2 * temperature), 50.0))  # each weight within [w / slack, w * slack]
    if top_p >= 1:
        return _Whole(weights).check(token, u, slack=slack, tolerance=tolerance)
    return _check_top_p(weights, token, u, top_p=top_p, slack=slack, tolerance=tolerance)


def _weights(scores: npt.NDArray[np.float32], temperature: float) -> npt.NDArray[np.float32]:
    """exp((l - max l) / T) in float32 (the best token weighs 1)."""
    import numpy as np

    weights = scores - scores.max()
    np.divide(weights, np.float32(temperature), out=weights)
    return np.exp(weights, out=weights)


def _target(u: float, total: float) -> float:
    """``u * total``, kept below ``total`` (the product of a u just under 1 may round up to it)."""
    import numpy as np

    return min(u * total, float(np.nextafter(total, 0.0)))


def _first_above(cumulative: npt.NDArray[np.float64], target: float) -> int:
    """The first index whose cumulative weight exceeds ``target`` (``target`` < the last)."""
    import numpy as np

    return int(np.searchsorted(cumulative, target, side="right"))


def _outside(value: float, lo: float, hi: float) -> float:
    """How far ``value`` lies outside [lo, hi] (0 inside)."""
    return max(lo - value, value - hi, 0.0)


class _Whole:
    """Every token kept (top_p >= 1): the cumulative weights as block sums, then cumulative
    sums within the one block asked about (a cumulative sum over the whole vocabulary costs
    about a millisecond a token). The blocks' ends are the partition's truth: within a block,
    the last token with weight closes the block at its end, so the intervals tile [0, W)."""

    def __init__(self, weights: npt.NDArray[np.float32]) -> None:
        import numpy as np

        self.size = len(weights)
        if self.size % BLOCK:
            weights = np.concatenate([weights, np.zeros(BLOCK - self.size % BLOCK, dtype=weights.dtype)])
        self.blocks = weights.reshape(-1, BLOCK)  # (n_blocks, BLOCK)
        self.ends = np.cumsum(self.blocks.sum(axis=1, dtype=np.float64))  # (n_blocks,)
        self.total = float(self.ends[-1])

    def _within(self, block: int) -> tuple[float, npt.NDArray[np.float64]]:
        """The block's start and its tokens' cumulative weights from 0, the last with weight at the block's end."""
        import numpy as np

        start = float(self.ends[block - 1]) if block else 0.0
        within = np.cumsum(self.blocks[block], dtype=np.float64) + start  # (BLOCK,)
        heavy = np.flatnonzero(self.blocks[block])
        if len(heavy):
            within = np.minimum(within, self.ends[block])
            within[heavy[-1] :] = self.ends[block]
        return start, within

    def select(self, u: float) -> int:
        target = _target(u, self.total)
        block = _first_above(self.ends, target)
        _, within = self._within(block)
        return block * BLOCK + _first_above(within, target)

    def interval(self, token: int) -> tuple[float, float]:
        """[lo, hi) of ``token`` in cumulative weight."""
        block, offset = divmod(token, BLOCK)
        start, within = self._within(block)
        return (float(within[offset - 1]) if offset else start), float(within[offset])

    def check(self, token: int, u: float, *, slack: float, tolerance: float) -> Check:
        lo, hi = self.interval(token)
        target = _target(u, self.total)
        distance = _outside(target, lo, hi) / self.total if not lo <= target < hi else 0.0
        if distance == 0.0:
            return Check(MATCH, 0.0)
        rest = self.total - hi
        start = lo / slack / (lo / slack + (self.total - lo) * slack)  # the interval's edges under any honest weights
        end = hi * slack / (hi * slack + rest / slack)
        inside = start - tolerance <= u < end + tolerance
        return Check(UNCERTAIN if inside else MISS, distance)


def _mass_above(values: npt.NDArray[np.float32], threshold: float) -> float:
    """The weight of ``values`` above ``threshold``, quickly (a float32 dot product: for choosing
    where to look, never for a verdict)."""
    import numpy as np

    return float(np.dot(values, (values > threshold).astype(np.float32)))


def _cut(weights: npt.NDArray[np.float32], goal: float) -> tuple[float, npt.NDArray[np.intp]]:
    """Where the shortest heaviest-first prefix reaching ``goal`` (> 0) ends: its last weight
    ``c`` (it holds every heavier token) and the ids of the tokens of weight ``c`` it holds
    (the lowest ids of that weight).

    Without sorting the vocabulary: thresholds a decade apart, one quick pass over the
    vocabulary each, find a decade that holds the cut; thresholds halfway in log space then
    split that band, the part above the cut set aside unsorted, until few enough tokens are
    left around it to be sorted (heaviest first, equal weights by lower id)."""
    import numpy as np

    low, high = 1e-2, 2.0  # the cut lies in (low, high]; every weight is at most 1
    while low > 1e-12 and _mass_above(weights, low) < goal * (1 + 1e-5):
        low, high = low * 0.1, low
    low = 0.0 if low <= 1e-12 else low
    band = np.flatnonzero((weights > low) & (weights <= high))
    values = weights[band]
    heavy = float(weights[weights > high].sum(dtype=np.float64)) if high < 2.0 else 0.0  # the mass above the band
    while len(band) > SORT_AT_MOST and high > low * (1 + 1e-6):
        middle = math.sqrt(low * high) if low > 0 else high * 1e-3
        upper = values > middle
        if heavy + _mass_above(values, middle) >= goal:
            band, values, low = band[upper], values[upper], middle
        else:
            heavy += float(values[upper].sum(dtype=np.float64))
            band, values, high = band[~upper], values[~upper], middle
    order = np.argsort(-values, kind="stable")  # band ascending: equal weights by lower id
    reached = heavy + np.cumsum(values[order], dtype=np.float64)
    if not len(reached) or reached[-1] < goal or heavy >= goal:
        return _cut_sorted(weights, goal)  # a float32 estimate misled a split (rare): the slow way
    end = int(np.searchsorted(reached, goal, side="left"))
    c = float(values[order[end]])
    inside = band[order[: end + 1]]
    return c, np.sort(inside[values[order[: end + 1]] == c])


def _cut_sorted(weights: npt.NDArray[np.float32], goal: float) -> tuple[float, npt.NDArray[np.intp]]:
    """:func:`_cut` by sorting the whole vocabulary."""
    import numpy as np

    order = np.argsort(-weights, kind="stable")
    reached = np.cumsum(weights[order], dtype=np.float64)
    end = min(int(np.searchsorted(reached, goal, side="left")), len(order) - 1)
    c = float(weights[order[end]])
    prefix = order[: end + 1]
    return c, np.sort(prefix[weights[prefix] == c])


def _kept(weights: npt.NDArray[np.float32], top_p: float) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float64]]:
    """The top-p set in ascending id order and its cumulative weights."""
    import numpy as np

    goal = top_p * float(weights.sum(dtype=np.float64))
    if goal <= 0:
        kept = np.array([int(np.argmax(weights))])
    else:
        c, tied = _cut(weights, goal)
        mask = weights > np.float32(c)
        mask[tied] = True
        kept = np.flatnonzero(mask)
    return kept, np.cumsum(weights[kept], dtype=np.float64)


def _check_top_p(
    weights: npt.NDArray[np.float32],
    token: int,
    u: float,
    *,
    top_p: float,
    slack: float,
    tolerance: float,
) -> Check:
    """The check under top-p. A match is read off the verifier's own top-p set. Otherwise the
    token is judged against every top-p set honest weights (each within ``slack`` of these)
    could make: a token lighter than the lightest any of them could keep is a miss; one that
    some could keep is `uncertain` when ``u`` falls between the lowest start and the highest
    end its interval could have. Both bounds come from two cuts: ``maybe`` holds every token an
    honest set could keep, ``sure`` only tokens every honest set keeps."""
    import numpy as np

    kept, cumulative = _kept(weights, top_p)
    where = int(np.searchsorted(kept, token))
    distance = None
    if where < len(kept) and kept[where] == token:
        total_kept = float(cumulative[-1])
        target = _target(u, total_kept)
        lo, hi = (float(cumulative[where - 1]) if where else 0.0), float(cumulative[where])
        if lo <= target < hi:
            return Check(MATCH, 0.0)
        distance = _outside(target, lo, hi) / total_kept
    total = float(weights.sum(dtype=np.float64))
    squeeze = slack * slack  # an honest weight may outrank another up to this factor heavier
    # An honest machine keeps token i when the mass ranked before it is below top_p times the
    # total; that mass is at least (mass heavier than w_i * squeeze) / slack and at most
    # (mass not lighter than w_i / squeeze) * slack, the total within [total / slack, total * slack].
    most, least = (top_p + tolerance) * total * squeeze, (top_p - tolerance) * total / squeeze
    maybe_from = _cut(weights, most)[0] / squeeze if most < total else 0.0  # weights from here may be kept
    sure_above = _cut(weights, least)[0] * squeeze if least > 0 else math.inf  # weights above this are kept
    w = float(weights[token])
    if w < maybe_from or w == 0.0:
        heavier = float(weights[weights > w].sum(dtype=np.float64))
        return Check(MISS, distance if distance is not None else max(heavier / total - top_p, 0.0))
    maybe, sure = weights >= maybe_from, weights > sure_above
    lo_min = float(np.sum(weights[:token], where=sure[:token], dtype=np.float64)) / slack
    lo_max = float(np.sum(weights[:token], where=maybe[:token], dtype=np.float64)) * slack
    rest_min = float(np.sum(weights[token + 1 :], where=sure[token + 1 :], dtype=np.float64)) / slack
    rest_max = float(np.sum(weights[token + 1 :], where=maybe[token + 1 :], dtype=np.float64)) * slack
    start = lo_min / (lo_min + w * slack + rest_max)
    end = (lo_max + w * slack) / (lo_max + w * slack + rest_min)
    inside = start - tolerance <= u < end + tolerance
    if distance is None:  # kept by some honest weights, not by these: how far u is from where it could be
        distance = _outside(u, start, end)
    return Check(UNCERTAIN if inside else MISS, distance)
