"""Ring inquiries: which of a ring's hosts made its audit fail.

A ring's answer is audited whole (`marketplace.trust.audits`). When the audit fails, the customer
is refunded at once, as for any host; but the text passed through several owners' machines,
so before anyone is punished the gateway finds out whose fault it was:

1. **Collecting** (`inquiry_open`). Each stage host hears of the inquiry when it next asks
   (`inquiries_wanted`, a stage process asks every few seconds: `mahout.ring.member`) and
   hands over what it kept of the request (`mahout.ring.evidence`: its inputs and outputs per
   position, the tail's drawn tokens), in parts that fit a request body (`evidence_store`).
   A stage that kept nothing says so (`parts` 0); one that says nothing within
   RING_EVIDENCE_WAIT_SECONDS is taken to have kept nothing.
2. **Checking**. A trusted host that holds the model and takes no part in the ring (nor does
   its owner) claims the check through the ordinary claim path (`inquiry_claim_payload`, kind
   "ring_check"), reads the evidence (`evidence_read`), recomputes every stage on its own
   inputs (`mahout.ring.blame`: the gateway never imports torch) and reports which stages,
   or the bridge, are at fault, and which links are disputed (`inquiry_verdict_report`). A checker that declines, or is
   silent for AUDIT_SCORE_TIMEOUT_SECONDS, hands it to another. One checker's word is not
   enough where a second could be had: a trusted host of yet another owner checks it again,
   and two verdicts that agree decide (on a disagreement, a third; a checker outvoted loses
   its trust: the check is a computation two honest machines agree on). With no such host,
   or none within AUDIT_SCORER_WAIT_SECONDS, the first verdict stands.
3. **Decided**. The hosts blamed go into maintenance with the evidence, lose their trust and
   forfeit their unvested earnings (`host_blame`, as for any failed audit); the checker is
   paid a scorer's fee (each checker whose verdict stands). The job, the answer and the
   evidence are deleted.

**A link dispute alone forfeits nothing.** A disputed link is one whose two ends' evidence
disagrees about what passed on it (stage k says it received other states than stage k-1 says
it sent; the head ran other tokens than the bridge submitted or the tail drew). Each link has
its own secret, known to its two ends only (`mesh.rings.selectors.link_secret`), and a stage
admits only its expected neighbour, so no third machine put a frame on it: one of its two
ends lies, and the evidence cannot say which. So, for each disputed link (`_dispute`):

* two hosts of different owners: **neither is blamed**: no maintenance, no lost trust, no
  forfeit. The pair is recorded (`mesh.rings.services.ring_link_dispute_record`), the ring is
  retired, and no plan puts the two at the ends of one link again for
  `mesh.rings.services.DISPUTE_AVOID_DAYS` days; the ring is planned again without them as
  neighbours. (Blaming both, as before, let one dishonest stage cost an honest neighbour up
  to seven days of earnings by lying about one frame.)
* one host at both ends (it runs both stages, or bridges and runs the head or the tail): that
  host is blamed: it lied either way.
* two hosts of one owner: both are blamed: that owner lied either way.

An end that fails a check of its own (it kept nothing, its layers do not recompute) is
blamed for that, dispute or not. Repeated disputes are not added up against a host: two
colluding neighbours could otherwise frame the honest stage between them.

A ring whose stages all run on its bridge's own host needs no inquiry: that host is blamed
as any host. When no checker took the inquiry within AUDIT_SCORER_WAIT_SECONDS, the bridge,
which delivered the text, is blamed, as before inquiries existed, and the log says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from billing import services as billing
from core.errors import ApiError
from core.events import announce_on_commit, queue_group
from hosts.models import TRUSTED, Host
from hosts.services import host_maintenance_enter
from marketplace.models import Audit, RingEvidence, RingInquiry, StageShare
from marketplace.trust import reputation
from marketplace.trust.scorer_fees import scorer_fee
from mesh.rings.models import RingPlan, RingStage
from mesh.rings.services import ring_link_dispute_record
from protocol.jobs import RING_CHECK, RingCheckPayload, RingCheckStage

logger = logging.getLogger(__name__)

BRIDGE = -1  # the bridge's index in a checker's verdict (`mahout.ring.blame.BRIDGE`)
PART_BYTES = 512 * 1024  # the most raw bytes one evidence part carries (base64 in JSON: under the body limit)


def host_blame(*, host: Host, why: str) -> None:
    """A host caught serving what the model did not compute: maintenance with the evidence,
    back to probation, its unvested earnings forfeited."""
    host_maintenance_enter(host=host, reason=why, by="verification")
    reputation.trust_revoke(host_id=host.pk)
    billing.earnings_forfeit(host=host, reason=why)


def _stage_hosts(plan: RingPlan) -> dict[int, int | None]:
    """Each stage's host id (a stage without its own host is run by the bridge)."""
    return {
        stage.index: stage.host_id or plan.bridge_host_id
        for stage in RingStage.objects.filter(plan=plan).order_by("index")
    }


def inquiry_open(*, audit: Audit, reason: str) -> bool:
    """Open an inquiry into a failed audit of a ring's job (in `audit_decide`'s transaction,
    before it deletes the job and answer). False for a job no ring served, or a ring whose
    stages all run on the audited host itself: that host is simply blamed."""
    share = StageShare.objects.filter(job_id=audit.job_id).select_related("plan").first()
    if share is None:
        return False
    plan = share.plan
    if set(_stage_hosts(plan).values()) <= {audit.host_id}:
        return False
    RingInquiry.objects.create(
        audit=audit,
        plan=plan,
        audit_reason=reason[:500],
        payload=audit.payload,
        token_ids=audit.token_ids,
        shared_output=True,
    )  # (marketplace rings share it: `mahout stage`)
    logger.warning("audit %s of ring %s failed: an inquiry asks its stages for their evidence", audit.pk, plan.pk)
    return True


# --- the stages' side -------------------------------------------------------------------------


def _runs_stage(plan: RingPlan, stage: int, host: Host) -> bool:
    return _stage_hosts(plan).get(stage) == host.pk


def _stage_complete(inquiry_id: int, stage: int) -> bool:
    rows = list(RingEvidence.objects.filter(inquiry_id=inquiry_id, stage=stage).values_list("parts", flat=True))
    return bool(rows) and (rows[0] == 0 or len(rows) == rows[0])


def inquiries_wanted(*, host: Host, plan_id: int, stage: int) -> list[dict]:
    """The inquiries of ring `plan_id` still waiting for this host's stage `stage`: each with
    the job whose request the stage must find (its request id starts ``job-<job>-``)."""
    plan = RingPlan.objects.filter(pk=plan_id).first()
    if plan is None or not _runs_stage(plan, stage, host):
        raise ApiError(404, f"No stage {stage} of ring {plan_id} that this host runs.", code="ring_not_found")
    wanted = []
    for inquiry_id, job_id in RingInquiry.objects.filter(plan=plan, status=RingInquiry.Status.COLLECTING).values_list(
        "pk", "audit__job_id"
    ):
        if not _stage_complete(inquiry_id, stage):
            wanted.append({"id": inquiry_id, "job": job_id})
    return wanted


@transaction.atomic
def evidence_store(*, host: Host, inquiry_id: int, stage: int, part: int, parts: int, data: bytes) -> dict:
    """One part of stage `stage`'s evidence (or, `parts` 0, its word that it kept nothing).
    Only the stage's own host may send it, while the inquiry collects; a part sent again
    replaces itself. When every stage has answered, the inquiry goes to checking."""
    inquiry = RingInquiry.objects.select_for_update().select_related("plan").filter(pk=inquiry_id).first()
    if inquiry is None or not _runs_stage(inquiry.plan, stage, host):
        raise ApiError(404, f"No inquiry {inquiry_id} into a ring stage this host runs.", code="inquiry_not_found")
    if inquiry.status != RingInquiry.Status.COLLECTING:
        raise ApiError(
            409,
            f"Inquiry {inquiry_id} no longer collects evidence ({inquiry.status}).",
            code="inquiry_closed",
            type="invalid_request_error",
        )
    most = max(1, settings.RING_EVIDENCE_MAX_BYTES // PART_BYTES)
    if not 0 <= parts <= most or (parts == 0 and (part != 0 or data)) or (parts and not 0 <= part < parts):
        raise ApiError(
            400,
            f"part {part} of {parts} is not a part of at most {most} parts (0 parts: nothing kept, with no data).",
            code="invalid_part",
            type="invalid_request_error",
            param="part",
        )
    if len(data) > PART_BYTES:
        raise ApiError(
            400,
            f"a part carries at most {PART_BYTES} bytes, not {len(data)}.",
            code="part_too_large",
            type="invalid_request_error",
            param="data",
        )
    if RingEvidence.objects.filter(inquiry=inquiry, stage=stage).exclude(parts=parts).exists():
        raise ApiError(
            409,
            f"stage {stage} already announced another number of parts.",
            code="parts_changed",
            type="invalid_request_error",
            param="parts",
        )
    RingEvidence.objects.update_or_create(
        inquiry=inquiry, stage=stage, part=part, defaults={"host": host, "parts": parts, "data": data}
    )
    complete = _stage_complete(inquiry.pk, stage)
    if complete and all(_stage_complete(inquiry.pk, index) for index in _stage_hosts(inquiry.plan)):
        _checking(inquiry)
    return {"complete": complete, "status": inquiry.status}


def _checking(inquiry: RingInquiry) -> None:
    inquiry.status, inquiry.checking_since = RingInquiry.Status.CHECKING, timezone.now()
    inquiry.save(update_fields=["status", "checking_since"])
    announce_on_commit(queue_group(inquiry.plan.model_id), {"type": "audit.queued"})  # waiting checkers look now


# --- the checker's side -----------------------------------------------------------------------


def _participant_owners(plan: RingPlan) -> set[int]:
    hosts = {pk for pk in (*_stage_hosts(plan).values(), plan.bridge_host_id) if pk is not None}
    return set(Host.objects.filter(pk__in=hosts).values_list("owner_id", flat=True))


def inquiry_claim_payload(*, host: Host, model_ids: list[int], boot: str = "") -> RingCheckPayload | None:
    """An inquiry for this trusted host to check (a compare-and-set), or None: one of the
    models it serves, of a ring neither it nor its owner takes part in, that it has not let
    go before. Asked by the claim path only when no customer's job and no audit was there."""
    if host.trusted_at is None or host.banned_at is not None or not model_ids:
        return None
    for inquiry in (
        RingInquiry.objects.filter(
            status=RingInquiry.Status.CHECKING, checker__isnull=True, plan__model_id__in=model_ids
        )
        .select_related("plan__model")
        .order_by("created_at")[:5]
    ):
        checked = {verdict["owner"] for verdict in inquiry.verdicts or []}
        if host.owner_id in _participant_owners(inquiry.plan) | checked or host.pk in (inquiry.declined_by or []):
            continue
        if RingInquiry.objects.filter(pk=inquiry.pk, status=RingInquiry.Status.CHECKING, checker__isnull=True).update(
            checker=host, checker_since=timezone.now()
        ):
            return _check_payload(inquiry)
    return None


def _check_payload(inquiry: RingInquiry) -> RingCheckPayload:
    parts = dict(
        RingEvidence.objects.filter(inquiry=inquiry).values("stage").annotate(n=Count("pk")).values_list("stage", "n")
    )
    announced = dict(RingEvidence.objects.filter(inquiry=inquiry).values_list("stage", "parts"))
    stages: list[RingCheckStage] = [
        {
            "index": stage.index,
            "start": stage.start,
            "end": stage.end,
            "parts": announced.get(stage.index, 0) if parts.get(stage.index) == announced.get(stage.index) else 0,
        }
        for stage in RingStage.objects.filter(plan=inquiry.plan).order_by("index")
    ]
    job = {key: value for key, value in (inquiry.payload or {}).items() if key != "id"}
    return {
        "id": inquiry.pk,
        "kind": RING_CHECK,
        "model": inquiry.plan.model.name,
        "job": job,  # type: ignore[typeddict-item]
        "tokens": [int(t) for t in inquiry.token_ids or []],
        "stages": stages,
        "shared_output": inquiry.shared_output,
    }


def _checker_inquiry(*, host: Host, inquiry_id: int, lock: bool = False) -> RingInquiry:
    rows = RingInquiry.objects.select_for_update() if lock else RingInquiry.objects
    inquiry = rows.select_related("plan__model", "audit__request").filter(pk=inquiry_id).first()
    if inquiry is None or inquiry.checker_id != host.pk or inquiry.status != RingInquiry.Status.CHECKING:
        raise ApiError(
            409,
            f"Inquiry {inquiry_id} is not this host's to check (decided, reassigned or never claimed).",
            code="inquiry_not_yours",
            type="invalid_request_error",
        )
    return inquiry


def evidence_read(*, host: Host, inquiry_id: int, stage: int, part: int) -> bytes:
    """One part of a stage's evidence, for the inquiry's checker only."""
    inquiry = _checker_inquiry(host=host, inquiry_id=inquiry_id)
    row = RingEvidence.objects.filter(inquiry=inquiry, stage=stage, part=part).exclude(parts=0).first()
    if row is None:
        raise ApiError(404, f"Stage {stage} sent no part {part} of its evidence.", code="evidence_not_found")
    return bytes(row.data)


def _ring_links(n_stages: int) -> set[tuple[int, int]]:
    """A ring's links as (sender, receiver): stage i -> i+1 (the tail's to the head), and the
    bridge's to the head and to the tail."""
    return {*((i, (i + 1) % n_stages) for i in range(n_stages)), (BRIDGE, 0), (BRIDGE, n_stages - 1)}


@transaction.atomic
def inquiry_verdict_report(
    *,
    host: Host,
    inquiry_id: int,
    verdict: str,
    blamed: list[int],
    reasons: list[str],
    disputed: list[list[int]] | None = None,
) -> str:
    """The checker's verdict: "blamed" with the stage indices at fault (`BRIDGE` for the
    bridge), the links disputed (``[sender, receiver]``: their ends disagree, neither shown at
    fault) and why, or "declined" (another checker is asked). Returns the inquiry's status."""
    inquiry = _checker_inquiry(host=host, inquiry_id=inquiry_id, lock=True)
    if verdict == "declined":
        _let_go(inquiry, why=f"declined: {'; '.join(reasons)[:300]!r}")
        return inquiry.status
    hosts = _stage_hosts(inquiry.plan)
    if any(index != BRIDGE and index not in hosts for index in blamed) or not (blamed or disputed):
        raise ApiError(
            400,
            f"blamed must name stages of the ring (0..{len(hosts) - 1}) or the bridge ({BRIDGE}), "
            "unless disputed names the links at issue.",
            code="invalid_blame",
            type="invalid_request_error",
            param="blamed",
        )
    links = sorted({tuple(link) for link in disputed or []})
    if any(link not in _ring_links(len(hosts)) for link in links):
        raise ApiError(
            400,
            f"disputed must name links of the ring as [sender, receiver]: stage i to i+1 (the last to 0), "
            f"or the bridge ({BRIDGE}) to the head or the tail.",
            code="invalid_dispute",
            type="invalid_request_error",
            param="disputed",
        )
    inquiry.verdicts = [
        *(inquiry.verdicts or []),
        {
            "checker": host.pk,
            "owner": host.owner_id,
            "blamed": sorted(set(blamed)),
            "disputed": [list(link) for link in links],
            "reasons": "; ".join(reasons).replace("\x00", "")[:4000],
        },
    ]
    inquiry.checker, inquiry.checker_since = None, None
    inquiry.save(update_fields=["verdicts", "checker", "checker_since"])
    _settle_verdicts(inquiry)
    return inquiry.status


def _settle_verdicts(inquiry: RingInquiry, *, waited: bool = False) -> None:
    """Decide once two checkers agree on whom to blame, or on one checker's word when no
    trusted host of another owner could give a second look (or none did in time: `waited`).
    Checkers whose verdict the decision goes against lose their trust: a check is a
    computation two honest machines agree on."""
    verdicts = inquiry.verdicts or []
    groups: dict[tuple, list[dict]] = {}
    for verdict in verdicts:
        groups.setdefault(_finding(verdict), []).append(verdict)
    agreed = next((group for group in groups.values() if len(group) >= 2), None)
    if agreed is None and len(verdicts) == 1 and (waited or not _second_look_possible(inquiry)):
        agreed = verdicts
    if agreed is None:  # a second look (or, on a disagreement, a third) is wanted
        announce_on_commit(queue_group(inquiry.plan.model_id), {"type": "audit.queued"})
        return
    hosts = _stage_hosts(inquiry.plan)
    _decide(
        inquiry,
        blamed=[(index, hosts.get(index, inquiry.plan.bridge_host_id)) for index in agreed[0]["blamed"]],
        verdict=agreed[0]["reasons"],
        disputed=[(int(a), int(b)) for a, b in agreed[0].get("disputed") or []],
    )
    for verdict in verdicts:
        if verdict in agreed:
            _checker_pay(inquiry, Host.objects.get(pk=verdict["checker"]))
        else:
            logger.warning(
                "ring inquiry %s: host %s's verdict %s was outvoted by %s; it loses its trust",
                inquiry.pk,
                verdict["checker"],
                _finding(verdict),
                _finding(agreed[0]),
            )
            reputation.trust_revoke(host_id=verdict["checker"])


def _finding(verdict: dict) -> tuple:
    """What a verdict found (whom it blames, which links it disputes): two checkers agree when theirs are equal."""
    return tuple(verdict["blamed"]), tuple(tuple(link) for link in verdict.get("disputed") or [])


def _second_look_possible(inquiry: RingInquiry) -> bool:
    """Whether a trusted host that holds the model, of an owner neither in the ring nor among
    the checkers so far, could check it."""
    owners = _participant_owners(inquiry.plan) | {verdict["owner"] for verdict in inquiry.verdicts or []}
    return (
        Host.objects.filter(TRUSTED.q(), qualifications__model_id=inquiry.plan.model_id)
        .exclude(owner_id__in=owners)
        .exists()
    )


def _let_go(inquiry: RingInquiry, *, why: str) -> None:
    logger.info("ring inquiry %s: host %s let the check go (%s)", inquiry.pk, inquiry.checker_id, why)
    inquiry.declined_by = [*(inquiry.declined_by or []), inquiry.checker_id]
    inquiry.checker, inquiry.checker_since = None, None
    inquiry.save(update_fields=["declined_by", "checker", "checker_since"])
    announce_on_commit(queue_group(inquiry.plan.model_id), {"type": "audit.queued"})


def _dispute(inquiry: RingInquiry, *, link: tuple[int, int], verdict: str) -> list[tuple[int, int | None]]:
    """A disputed link (the module's rule): the ends to blame where the dispute itself shows
    who lied (one host, or one owner, at both ends), else none: the pair is recorded and the
    ring retired, nobody forfeits."""
    hosts = _stage_hosts(inquiry.plan)
    sender, receiver = link
    ends = [(index, inquiry.plan.bridge_host_id if index == BRIDGE else hosts.get(index)) for index in link]
    (_, first), (_, second) = ends
    if first is None or second is None:  # (no host at an end: nobody to blame or keep apart)
        return []
    if first == second:
        return ends[:1]
    owners = dict(Host.objects.filter(pk__in=[first, second]).values_list("pk", "owner_id"))
    if owners.get(first) is not None and owners.get(first) == owners.get(second):
        return ends
    logger.warning(
        "ring inquiry %s: link %s -> %s disputed and neither end shown at fault: no forfeit; ring %s retired "
        "and the pair kept apart",
        inquiry.pk,
        sender,
        receiver,
        inquiry.plan_id,
    )
    ring_link_dispute_record(plan_id=inquiry.plan_id, upstream=sender, downstream=receiver, reason=verdict)
    return []


def _decide(
    inquiry: RingInquiry,
    *,
    blamed: list[tuple[int, int | None]],
    verdict: str,
    disputed: Sequence[tuple[int, int]] = (),
) -> None:
    """Blame the hosts found at fault (each once, with every reason), settle the disputed links
    (`_dispute`: most blame nobody), and delete what was kept."""
    request = inquiry.audit.request
    for link in disputed:
        blamed = [*blamed, *(end for end in _dispute(inquiry, link=link, verdict=verdict) if end not in blamed)]
    by_host: dict[int, list[int]] = {}
    for index, host_id in blamed:
        if host_id is not None:
            by_host.setdefault(host_id, []).append(index)
    for host_id, indices in by_host.items():
        roles = ", ".join("the bridge" if i == BRIDGE else f"stage {i}" for i in indices)
        why = (
            f"Failed verification as {roles} of ring {inquiry.plan_id}: {verdict[:300]} (audit {inquiry.audit_id} "
            f"of request {request.public_id}: {inquiry.audit_reason[:200]})."
        )
        host_blame(host=Host.objects.get(pk=host_id), why=why)
    inquiry.status, inquiry.decided_at, inquiry.verdict = RingInquiry.Status.DECIDED, timezone.now(), verdict
    inquiry.blamed = [{"stage": index, "host": host_id} for index, host_id in blamed]
    inquiry.payload, inquiry.token_ids = None, None
    inquiry.save(update_fields=["status", "decided_at", "verdict", "blamed", "payload", "token_ids"])
    RingEvidence.objects.filter(inquiry=inquiry).delete()


def _checker_pay(inquiry: RingInquiry, host: Host) -> None:
    """A scorer's fee (`marketplace.trust.scorer_fees.scorer_fee`), bounded as an audit's is."""
    fee = min(scorer_fee(inquiry.audit.request), inquiry.audit.platform_ucents // 2)
    if fee > 0:
        billing.audit_score_pay(
            host=host,
            amount_ucents=fee,
            reference=f"ring-inquiry-{inquiry.pk}",
            memo=f"checked ring inquiry {inquiry.pk}",
        )


def inquiries_watch(*, now: datetime | None = None) -> int:
    """The periodic part: an inquiry whose stages did not all answer within
    RING_EVIDENCE_WAIT_SECONDS is checked with what came (the silent ones kept nothing); a
    checker silent past AUDIT_SCORE_TIMEOUT_SECONDS loses it; one nobody checked within
    AUDIT_SCORER_WAIT_SECONDS blames the bridge. Returns how many were decided."""
    now = now or timezone.now()
    for inquiry in RingInquiry.objects.select_related("plan").filter(
        status=RingInquiry.Status.COLLECTING,
        created_at__lt=now - timedelta(seconds=settings.RING_EVIDENCE_WAIT_SECONDS),
    ):
        with transaction.atomic():
            if RingInquiry.objects.filter(pk=inquiry.pk, status=RingInquiry.Status.COLLECTING).exists():
                _checking(inquiry)
    silent = now - timedelta(seconds=settings.AUDIT_SCORE_TIMEOUT_SECONDS)
    for inquiry in RingInquiry.objects.select_related("plan").filter(
        status=RingInquiry.Status.CHECKING, checker_since__lt=silent
    ):
        with transaction.atomic():
            _let_go(inquiry, why=f"no verdict within {settings.AUDIT_SCORE_TIMEOUT_SECONDS:.0f} s")
    decided = 0
    waited = now - timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS)
    for inquiry in RingInquiry.objects.select_related("plan", "audit__request").filter(
        Q(checker__isnull=True), status=RingInquiry.Status.CHECKING, checking_since__lt=waited
    ):
        with transaction.atomic():
            if (
                not RingInquiry.objects.select_for_update()
                .filter(pk=inquiry.pk, status=RingInquiry.Status.CHECKING, checker__isnull=True)
                .exists()
            ):
                continue
            if inquiry.verdicts:  # a verdict waiting for a second look nobody gave: it stands (or, split, the first)
                logger.warning(
                    "ring inquiry %s: no second checker looked within %.0f s; the first verdict stands",
                    inquiry.pk,
                    settings.AUDIT_SCORER_WAIT_SECONDS,
                )
                inquiry.verdicts = inquiry.verdicts[:1]
                _settle_verdicts(inquiry, waited=True)
                decided += 1
                continue
            logger.warning(
                "ring inquiry %s: no trusted host outside the ring checked it within %.0f s; its bridge is blamed",
                inquiry.pk,
                settings.AUDIT_SCORER_WAIT_SECONDS,
            )
            _decide(
                inquiry,
                blamed=[(BRIDGE, inquiry.plan.bridge_host_id)],
                verdict="no trusted host outside the ring could check its stages: the bridge, which delivered the "
                "text, is blamed",
            )
            decided += 1
    return decided


def inquiry_summary() -> dict:
    """Inquiries by status, for the operator's pool page."""
    return {status: RingInquiry.objects.filter(status=status).count() for status in RingInquiry.Status.values}


__all__ = [
    "BRIDGE",
    "PART_BYTES",
    "evidence_read",
    "evidence_store",
    "host_blame",
    "inquiries_wanted",
    "inquiries_watch",
    "inquiry_claim_payload",
    "inquiry_open",
    "inquiry_summary",
    "inquiry_verdict_report",
]
