"""Reputation: what a host has earned by serving, and what it buys.

A new host is in **probation**. It leaves probation (`Host.trusted_at` is set) once it has
passed `CANARY_TRUST_AFTER` canaries with none failed, completed `TRUST_AFTER_JOBS` jobs and
been a host for `TRUST_AFTER_SECONDS`; a failed canary puts it back (and in maintenance).
What trust buys:
- more work at once: a probation host runs at most `HOST_PROBATION_MAX_JOBS` jobs, a trusted
  one its slots (at most `HOST_TRUSTED_MAX_JOBS`): `Host.claim_cap`;
- offers first: routing orders the warm set trusted first, then by measured speed and load
  (`marketplace.trust.routing`);
- the requests whose customers asked for trusted hosts only (`Job.trusted_only`);
- rare canaries (`marketplace.lifecycle.canaries`) and, after `EARNINGS_VEST_SECONDS`, payable earnings.

Speed is what the gateway measured (`Host.measured_tps`, a moving average of tokens/s over
the host's own completed jobs), never what it reported: a reported figure counts at most
`ROUTING_UNMEASURED_MAX_TPS` until measured, and a report over twice the measured speed
marks the host *overstated* (its report ignored, its offers after honest hosts').
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, F, Max, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from hosts.models import Host
from hosts.services import host_maintenance_enter
from marketplace.models import Audit, CanaryCheck, Job, Request

SPEED_WEIGHT = 0.3  # each measured job moves the average this far towards itself
MIN_MEASURED_TOKENS = 8  # shorter answers say more about the first token than the speed
OVERSTATED_RATIO = 2.0


def overstated(*, reported_tps: float | None, measured_tps: float | None) -> bool:
    return bool(reported_tps and measured_tps and reported_tps > OVERSTATED_RATIO * measured_tps)


def routing_speed(*, reported_tps: float | None, measured_tps: float | None) -> float:
    """The speed routing weighs a host by: measured, else a bounded report."""
    if measured_tps:
        return measured_tps
    return min(reported_tps or 1.0, settings.ROUTING_UNMEASURED_MAX_TPS)


def speed_measured(*, job: Job, completion_tokens: int, now: datetime) -> None:
    """Fold a completed job's tokens/s (first token to completion) into the host's average."""
    if job.host_id is None or job.first_token_at is None or completion_tokens < MIN_MEASURED_TOKENS:
        return
    seconds = (now - job.first_token_at).total_seconds()
    if seconds <= 0.05:
        return
    tps = (completion_tokens - 1) / seconds
    Host.objects.filter(pk=job.host_id).update(
        measured_tps=Coalesce(F("measured_tps") * (1 - SPEED_WEIGHT) + Value(SPEED_WEIGHT * tps), Value(tps))
    )


def _canary_counts(host_id: int) -> dict[str, int]:
    return CanaryCheck.objects.filter(host_id=host_id).aggregate(
        passed=Count("id", filter=Q(verdict=CanaryCheck.Verdict.PASSED)),
        failed=Count("id", filter=Q(verdict=CanaryCheck.Verdict.FAILED)),
        void=Count("id", filter=Q(verdict=CanaryCheck.Verdict.VOID)),
    )


def canaries_vouch(*, host_id: int) -> bool:
    """Enough canaries passed, none failed; each void (a canary the host died on, declined
    or blamed) cancels a pass, so voiding what looks like a check buys nothing."""
    canaries = _canary_counts(host_id)
    return not canaries["failed"] and canaries["passed"] - canaries["void"] >= settings.CANARY_TRUST_AFTER


def trust_review(*, host_id: int, now: datetime | None = None) -> bool:
    """Promote a probation host that has earned it; True if it was promoted now. One query
    for a host already trusted."""
    now = now or timezone.now()
    host = Host.objects.in_probation().filter(pk=host_id).only("pk", "created_at").first()
    if host is None or now - host.created_at < timedelta(seconds=settings.TRUST_AFTER_SECONDS):
        return False
    if not canaries_vouch(host_id=host_id):
        return False
    if Job.objects.filter(host_id=host_id, status=Job.Status.COMPLETED).count() < settings.TRUST_AFTER_JOBS:
        return False
    return trust_grant(host_id=host_id, now=now)


def trust_grant(*, host_id: int, now: datetime | None = None) -> bool:
    """Out of probation now (it earned it, or it is the operator's own machine: the demo's
    bundled host); False if it was not in probation (trusted already, or banned)."""
    return bool(Host.objects.in_probation().filter(pk=host_id).update(trusted_at=now or timezone.now()))


def trust_revoke(*, host_id: int) -> bool:
    """Back to probation (a failed canary, or a scorer too often in an audit's minority)."""
    return bool(Host.objects.filter(pk=host_id, trusted_at__isnull=False).update(trusted_at=None))


def scorer_owner_seasoned(*, now: datetime | None = None) -> Q:
    """Hosts whose owner has a history, as a condition on `Host`: who may score an audit
    (`marketplace.trust.audits`) besides being trusted. The owner's account is at least
    AUDIT_SCORER_OWNER_MIN_AGE_DAYS old, and its own hosts' jobs passed at least
    AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS audits that were read (tokens checked: a pass nobody
    read vouches for nothing).

    Why: an audit is decided by owners' votes (a pass/fail split goes to a third owner, and
    the minority of a decided split gets a strike), and an owner is only a confirmed e-mail,
    which is free. Without a history a cheat opens a second account the same day and
    outvotes the honest scorer of its own answers; with one, every extra vote costs weeks and
    work the platform checked, the same currency trust is paid in."""
    now = now or timezone.now()
    seasoned = Q(owner__date_joined__lte=now - timedelta(days=settings.AUDIT_SCORER_OWNER_MIN_AGE_DAYS))
    if settings.AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS > 0:
        seasoned &= Q(
            owner_id__in=Audit.objects.filter(status=Audit.Status.PASSED, checked__gt=0)
            .values("host__owner_id")
            .annotate(passed=Count("pk"))
            .filter(passed__gte=settings.AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS)
            .values("host__owner_id")
        )
    return seasoned


@dataclass(frozen=True)
class Reputation:
    status: str  # "probation", "trusted" or "banned"
    canaries_passed: int
    canaries_failed: int
    jobs_completed: int
    jobs_failed: int
    failovers_caused: int  # attempts that died after delivering text: someone else had to finish
    measured_tps: float | None
    reported_tps: float | None
    overstated: bool
    claim_cap: int

    @property
    def completion_rate(self) -> float | None:
        ended = self.jobs_completed + self.jobs_failed
        return self.jobs_completed / ended if ended else None


def reputation_of(host: Host) -> Reputation:
    """Everything the reputation counts, for the host's pages and the operator's."""
    canaries = _canary_counts(host.pk)
    jobs = Job.objects.filter(host=host).aggregate(
        completed=Count("id", filter=Q(status=Job.Status.COMPLETED)),
        failed=Count("id", filter=Q(status=Job.Status.FAILED)),
        failovers=Count("id", filter=Q(status=Job.Status.FAILED, generated_chars__gt=0)),
    )
    reported = host.qualifications.aggregate(best=Max("gen_tps"))["best"]
    return Reputation(
        status=host.standing,
        canaries_passed=canaries["passed"],
        canaries_failed=canaries["failed"],
        jobs_completed=jobs["completed"],
        jobs_failed=jobs["failed"],
        failovers_caused=jobs["failovers"],
        measured_tps=host.measured_tps,
        reported_tps=reported,
        overstated=overstated(reported_tps=reported, measured_tps=host.measured_tps),
        claim_cap=host.claim_cap,
    )


# --- discipline: failures that rest a host ---------------------------------------


def blame_corrected(*, request: Request, host: Host) -> int:
    """`host` served a request an earlier host said could not be run: that host's failure
    was its own after all (it counts toward its maintenance). Returns how many were."""
    blamed = list(
        Job.objects.filter(request_id=request.pk, fail_cause="request")
        .exclude(host_id=host.pk)
        .values_list("pk", "host_id")
    )
    if blamed:
        Job.objects.filter(pk__in=[pk for pk, _ in blamed]).update(fail_cause="host")
        for host_id in {host_id for _, host_id in blamed}:
            host_rest_if_unreliable(host_id=host_id)
    return len(blamed)


def host_rest_if_unreliable(*, host_id: int | None) -> bool:
    """Put a host in maintenance once it has dropped or failed more than
    HOST_MAX_FAILURES_PER_HOUR jobs in the last hour; its owner sees why."""
    if host_id is None:
        return False
    since = timezone.now() - timedelta(hours=1)
    failures = (
        Job.objects.filter(host_id=host_id, status=Job.Status.FAILED, finished_at__gte=since)
        .exclude(fail_cause="request")
        .count()
    )
    if failures <= settings.HOST_MAX_FAILURES_PER_HOUR:
        return False
    reason = (
        f"{failures} jobs dropped or failed in the last hour (the limit is {settings.HOST_MAX_FAILURES_PER_HOUR}). "
        "Check the machine, then resume it."
    )
    return host_maintenance_enter(host=Host.objects.get(pk=host_id), reason=reason, by="automatic")
