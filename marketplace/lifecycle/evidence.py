"""A completion is evidence: before any money moves, the host's own word that it generated
an answer is held against what it must carry.

Every chat and completion job is drawn by the specified sampler from a seed the gateway
fixes (`marketplace.trust.audits.job_seed`), and mahout reports the token ids it drew with its
completion. Checked here, on every completion, before its settlement:

- the ids are there (a completion without them is the host's failure: a current mahout, a
  ring's bridge and an MoE coordinator always send them);
- read from the gateway's vocabulary copy (`catalog.tokenizer.GgufTokenizer.drawn`, no
  weights): every id is in the vocabulary, no end of generation comes before the last id,
  and an answer that ends on its own ("stop") ends in the model's end of generation or in
  the token that completes a stop string (the customer's, or the chat's end of turn);
- an answer with no text of its own is exactly one draw, or a stop string's few: it costs
  one prefill to recompute, so it is recomputed every time, with the gateway's verifier
  where it holds the weights (`Verifier.audit` over every token). Where the gateway does
  not hold them, the job is audited (`always`) by trusted hosts, its share in escrow.

A completion that fails is refused: the attempt is the host's failure (`job_fail`, cause
"host": nothing paid, the request requeued before its first token, continued after it), and
one whose draw the model could not have made (`proven`) puts its host in maintenance with
the evidence, as a failed audit does (`ring_inquiries.host_blame`). This closes the door a
host stood in by completing every job at once with nothing: the empty answer is the first
draw, and the seed's first draw is almost never the end of generation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from catalog.tokenizer import GgufTokenizer, tokenizer_for
from marketplace.models import Job, Request
from protocol.jobs import JobPayload, job_stop_strings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    """Why a completion is not evidence of the answer it claims; `proven`: no honest draw of
    the model could be it (the host is blamed, not only failed)."""

    reason: str
    proven: bool = False


@dataclass(frozen=True)
class Verdict:
    refusal: Refusal | None = None
    audit: bool = False  # the check needs the weights the gateway lacks: audit it (by trusted hosts)


def completion_checked(
    *,
    request: Request,
    job: Job,
    own_text: str,
    token_ids: list[int] | None,
    finish_reason: str,
    payload: Callable[[], JobPayload],
) -> Verdict:
    """Whether `token_ids`, with `finish_reason`, can be the host's draw of `own_text` (its own
    part of the delivered answer) for the job it was sent (`payload()`, rendered again only when
    a check needs it: a stop string's end, an empty answer)."""
    if request.kind not in (Request.Kind.CHAT, Request.Kind.COMPLETION):
        return Verdict()
    if not token_ids:
        return Verdict(
            Refusal("its completion reported no token ids: an answer is paid only with the tokens drawn for it")
        )
    tokenizer = tokenizer_for(request.model.tokenizer)
    if isinstance(tokenizer, GgufTokenizer):
        problem = shape_problem(
            tokenizer,
            token_ids=token_ids,
            own_text=own_text,
            finish_reason=finish_reason,
            stops=lambda: job_stop_strings(payload()),
        )
        if problem is not None:
            return Verdict(Refusal(problem, proven=True))
    if own_text:
        return Verdict()
    return _first_draw_checked(request=request, payload=payload(), token_ids=token_ids, finish_reason=finish_reason)


def shape_problem(
    tokenizer: GgufTokenizer, *, token_ids: list[int], own_text: str, finish_reason: str, stops: Callable[[], list[str]]
) -> str | None:
    drawn = tokenizer.drawn(token_ids)
    if drawn is None:
        return "a reported token id is not in the model's vocabulary"
    if drawn.eog_inside:
        return "its token ids go on past an end of generation"
    if finish_reason != "stop" or drawn.ended:
        return None
    if any((own_text + stop).encode() in drawn.spelled for stop in stops() if stop):
        return None  # stopped at a stop string: its last token completed one
    return "it ended with 'stop' on neither the model's end of generation nor a stop string"


def _first_draw_checked(*, request: Request, payload: JobPayload, token_ids: list[int], finish_reason: str) -> Verdict:
    """An answer with no text of its own, recomputed now (one prefill) where the gateway
    holds the weights; else audited by trusted hosts."""
    from marketplace.trust.audit_scoring import VERIFYING, _verifier
    from marketplace.trust.audits import audit_weights
    from scorer.verify import Unauditable

    path = audit_weights(request.model)
    if path is None:
        return Verdict(audit=True)
    try:
        with VERIFYING:
            result = _verifier(path).audit(  # type: ignore[attr-defined]
                payload,
                token_ids=[int(t) for t in token_ids],
                text="",
                finish_reason=finish_reason,
                seed=int(payload["params"]["seed"]),
                sample=None,
            )
    except (LookupError, Unauditable) as cannot:
        logger.warning("empty answer of request %s cannot be recomputed here (%s): audited", request.public_id, cannot)
        return Verdict(audit=True)
    if result.reason is None:
        return Verdict()
    return Verdict(Refusal(f"an empty answer that is not the model's draw: {result.reason}", proven=True))
