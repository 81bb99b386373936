"""The gateway's own reading of an audit (on the Celery workers): the real model, loaded once
per worker process and file, replays the audited job and says whether every token checked is
the seed's draw (`scorer.verify.Verifier`); `audit_score_pending` decides the pending audits
the gateway scores itself (`marketplace.trust.audits` for the draw and the decision)."""

from __future__ import annotations

import atexit
import threading

from django.conf import settings

from marketplace.models import Audit
from marketplace.trust.audits import (
    _audit_to_hosts,
    _gateway_decides,
    audit_scorers_watch,
    audit_unscored,
    audit_weights,
)

_verifiers: dict[str, object] = {}
VERIFYING = threading.Lock()  # a process' verifier is one llama.cpp context: one reading at a time


@atexit.register
def _verifiers_close() -> None:
    """Close the cached models before the interpreter tears llama.cpp's bindings down (else
    each one's finaliser fails then, printing "Exception ignored")."""
    for verifier in _verifiers.values():
        verifier.close()  # type: ignore[attr-defined]
    _verifiers.clear()


def _verifier(path: str) -> object:
    """The real model, loaded once per worker process and file (one at a time)."""
    from scorer.verify import Verifier

    if path not in _verifiers:
        for old in _verifiers.values():
            old.close()  # type: ignore[attr-defined]
        _verifiers.clear()
        _verifiers[path] = Verifier(path, threads=settings.CANARY_SCORER_THREADS)
    return _verifiers[path]


def audit_verdict(audit: Audit) -> tuple[str | None, dict]:
    """Why the audited answer cannot be the real model's draw (None: it passed), and the counts."""
    if not audit.token_ids:  # (an empty answer too: it is one draw, the end of generation, and must say so)
        return "its host did not report the tokens it generated, so its answer cannot be checked", {}
    path = audit_weights(audit.request.model)
    if path is None:
        raise LookupError(f"the weights of {audit.request.model.name} are no longer on this gateway")
    with VERIFYING:
        result = _verifier(path).audit(  # type: ignore[attr-defined]
            audit.payload,
            token_ids=[int(t) for t in audit.token_ids],
            text=audit.text,
            finish_reason=audit.finish_reason,
            seed=audit.seed,
            logprobs=audit.logprobs,
            sample=settings.AUDIT_TOKENS or None,
        )
    counts = {"checked": result.checked, "uncertain": result.uncertain, "misses": len(result.misses)}
    return result.reason, counts


def audit_score_pending(*, limit: int = 10) -> int:
    """Score pending audits, oldest first, and decide them. Returns how many were decided.
    One the verifier cannot read is never released unchecked: weights that vanished hand it to
    independent host scorers (unscored where there are none); an answer it cannot read
    (`Unauditable`: admission refuses what outgrows its context, so a grammar it cannot build,
    or a host's tokens past the job's bounds) is unscored (`audit_unscored`)."""
    from scorer.verify import Unauditable

    decided = audit_scorers_watch()
    for audit_id in list(
        Audit.objects.filter(status=Audit.Status.PENDING, by_hosts=False)
        .order_by("created_at")
        .values_list("pk", flat=True)[:limit]
    ):
        audit = (
            Audit.objects.select_related("request__model", "host")
            .filter(pk=audit_id, status=Audit.Status.PENDING)
            .first()
        )
        if audit is None:
            continue
        try:
            reason, counts = audit_verdict(audit)
        except LookupError as gone:  # the file is gone: hosts that hold the model read it
            decided += _audit_to_hosts(audit, why=str(gone))
        except Unauditable as cannot:
            decided += audit_unscored(audit=audit, why=f"the gateway's verifier cannot read it: {cannot}")
        else:
            decided += _gateway_decides(audit, reason=reason, counts=counts)
    return decided
