"""Audits: a random share of real jobs re-read under the real model before their host is paid.

Every chat and completion job is sampled with one specified sampler (`protocol.sampling`)
from a seed the gateway fixes (`job_seed`: the customer's `seed`, else a keyed hash of the
job's id), so anyone who holds the model can tell whether a token is the one that seed's
draw selects. Mahout reports the token ids it generated with its completion.

At completion (`audit_open`, in the settlement's transaction) a job is chosen for an audit
with probability `AUDIT_RATE`, or `AUDIT_PROBATION_RATE` for a host in probation. A chosen
job settles as any other (the customer's answer and bill are not delayed) except that the
host's share goes to the audit escrow. The rendered prompt, the delivered text and the
tokens wait on the `Audit` row; the request's own copy is deleted as for every job.

A Celery worker (`audit_score_pending`) loads the model and re-reads the answer in one
prefill pass (`mahout.verify.Verifier`): every token must be the seed's draw under the
model's logits, within a tolerance for honest machines' arithmetic. A pass pays the host
out of the escrow; a failure refunds the customer (the host's share from the escrow, the
platform's from its revenue), puts the host in maintenance with the evidence and forfeits
its unvested earnings. Either way the prompt, text and tokens are deleted then.

What is auditable (`mahout.verify.auditable`): first attempts of chats and completions
without a grammar (`response_format`, tools), not a ring, on a model whose weights the
gateway has (`catalog.tokenizer.weights_on_gateway`). A chosen job whose host reported no
tokens fails: a current mahout always reports them.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import random
from collections.abc import Callable

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing import services as billing
from catalog.models import CatalogModel
from catalog.tokenizer import weights_on_gateway
from hosts.models import Host
from hosts.services import host_maintenance_enter
from marketplace import reputation
from marketplace.models import Audit, Job, Request

logger = logging.getLogger(__name__)

MAX_TOKENS_KEPT = 16_384  # token ids a completion may report (more than any context a host runs)


def job_seed(*, job_id: int, params: dict) -> int:
    """The job's sampling seed: the customer's `seed` (reproducible answers), else a hash of
    the job's id keyed with the gateway's secret, so a host cannot predict another job's."""
    if params.get("seed") is not None:
        return int(params["seed"])
    digest = hmac.new(settings.SECRET_KEY.encode(), f"job-seed:{job_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: a signed 64-bit column holds it


def audit_rate(*, host: Host) -> float:
    """The chance that one of `host`'s jobs is audited: every job of a host in probation
    (by default), a few percent of a trusted host's."""
    if not settings.AUDIT_ENABLED:
        return 0.0
    return settings.AUDIT_RATE if host.trusted_at is not None else settings.AUDIT_PROBATION_RATE


def audit_weights(model: CatalogModel, *, assemble: bool = True) -> str | None:
    """The weights audits of `model` are read with (None: the gateway cannot audit it)."""
    return weights_on_gateway(tokenizer=model.tokenizer, weights_path=model.weights_path, assemble=assemble)


def audit_wanted(
    *, request: Request, job: Job, host: Host, payload: Callable[[], dict], excluded: Callable[[], bool],
    always: bool = False,
) -> dict | None:
    """The job as its host received it when this completed job is to be audited (the draw
    says so, or `always`: a canary judged by its audit; and it can be), else None. `payload`
    and `excluded` (a canary judged by its reference, a ring: checked otherwise) cost queries,
    so they are asked only for a job the draw chose."""
    if request.kind not in (Request.Kind.CHAT, Request.Kind.COMPLETION) or job.attempt != 1:
        return None
    if (not always and random.random() >= audit_rate(host=host)) or audit_weights(request.model, assemble=False) is None:
        return None
    from mahout.verify import auditable  # (imports llama_cpp's bindings: only when a job is drawn)

    job_as_sent = payload()
    return job_as_sent if auditable(job_as_sent) and not excluded() else None


def audit_open(*, request: Request, job: Job, host: Host, payload: dict, text: str, token_ids: list[int] | None,
               finish_reason: str, host_ucents: int, platform_ucents: int) -> Audit:
    """Keep what the audit needs (the job, its answer and tokens) beside the escrowed shares.
    In the settlement's transaction."""
    return Audit.objects.create(
        job=job, host=host, request=request, host_ucents=host_ucents, platform_ucents=platform_ucents,
        seed=int(payload["params"]["seed"]), payload=payload, text=text, token_ids=token_ids, finish_reason=finish_reason,
    )


# --- scoring (on the Celery workers) --------------------------------------------------------

_verifiers: dict[str, object] = {}


def _verifier(path: str) -> object:
    """The real model, loaded once per worker process and file (one at a time)."""
    from mahout.verify import Verifier

    if path not in _verifiers:
        for old in _verifiers.values():
            old.close()  # type: ignore[attr-defined]
        _verifiers.clear()
        _verifiers[path] = Verifier(path, threads=settings.CANARY_SCORER_THREADS)
    return _verifiers[path]


def audit_verdict(audit: Audit) -> tuple[str | None, dict]:
    """Why the audited answer cannot be the real model's draw (None: it passed), and the counts."""
    if not audit.token_ids:
        if not audit.text:
            return None, {"checked": 0, "uncertain": 0, "misses": 0}  # nothing generated: nothing to check
        return "its host did not report the tokens it generated, so its answer cannot be checked", {}
    path = audit_weights(audit.request.model)
    if path is None:
        raise LookupError(f"the weights of {audit.request.model.name} are no longer on this gateway")
    result = _verifier(path).audit(  # type: ignore[attr-defined]
        audit.payload, token_ids=[int(t) for t in audit.token_ids], text=audit.text, finish_reason=audit.finish_reason,
        seed=audit.seed,
    )
    counts = {"checked": result.checked, "uncertain": result.uncertain, "misses": len(result.misses)}
    return result.reason, counts


def audit_score_pending(*, limit: int = 10) -> int:
    """Score pending audits, oldest first, and decide them. Returns how many were decided."""
    from mahout.verify import Unauditable

    decided = 0
    for audit_id in list(Audit.objects.filter(status=Audit.Status.PENDING).order_by("created_at")
                         .values_list("pk", flat=True)[:limit]):
        audit = Audit.objects.select_related("request__model", "host").filter(pk=audit_id, status=Audit.Status.PENDING).first()
        if audit is None:
            continue
        try:
            reason, counts = audit_verdict(audit)
        except (LookupError, Unauditable) as cannot:  # the file is gone, or the answer outgrew the verifier's context
            logger.warning("audit %s: %s; released unchecked", audit.pk, cannot)
            reason, counts = None, {}
        decided += audit_decide(audit=audit, reason=reason, counts=counts)
    return decided


@transaction.atomic
def audit_decide(*, audit: Audit, reason: str | None, counts: dict) -> bool:
    """Record the verdict once (a compare-and-set from pending) and move the money: the
    escrowed share to the host, or everything back to the customer and the host into
    maintenance with the evidence. Deletes the prompt, text and tokens. False when
    decided elsewhere."""
    status = Audit.Status.PASSED if reason is None else Audit.Status.FAILED
    if not Audit.objects.filter(pk=audit.pk, status=Audit.Status.PENDING).update(
        status=status, reason=(reason or "")[:500], payload=None, text="", token_ids=None, decided_at=timezone.now(),
        **counts,
    ):
        return False
    request = audit.request
    if reason is None:
        billing.audit_release(host=audit.host, amount_ucents=audit.host_ucents, reference=f"audit-{audit.pk}",
                              memo=f"audit of request {request.public_id} passed")
        return True
    billing.audit_refund(user=request.user, host_ucents=audit.host_ucents, platform_ucents=audit.platform_ucents,
                         reference=f"audit-{audit.pk}",
                         memo=f"request {request.public_id} refunded: its host failed verification")
    why = f"Failed verification: {reason} (audit {audit.pk} of request {request.public_id})."
    host_maintenance_enter(host=audit.host, reason=why, by="verification")
    reputation.trust_revoke(host_id=audit.host_id)
    billing.earnings_forfeit(host=audit.host, reason=why)
    return True


def audit_summary() -> dict:
    """Audits by status, and the models the gateway cannot audit (no weights on its disk)."""
    counts = {status: Audit.objects.filter(status=status).count() for status in Audit.Status.values}
    unverifiable = [model.name for model in CatalogModel.objects.filter(active=True, kind=CatalogModel.Kind.CHAT)
                    if audit_weights(model, assemble=False) is None]
    return {**counts, "unverifiable_models": unverifiable}
