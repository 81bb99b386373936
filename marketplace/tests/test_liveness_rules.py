"""The liveness rules (`marketplace.models.Liveness`) over jobs in every state: each `Q` holds
exactly the jobs it names, asked as a filter (the sweeps) or of one job (`request_watch`);
and the watchdog's sweeps and a quiet stream's `request_watch` reach the same verdict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pytest
from django.db import transaction
from django.db.models import BooleanField, ExpressionWrapper
from django.utils import timezone

from hosts.models import Host, Qualification
from marketplace import services
from marketplace.models import Job, Liveness
from marketplace.tests.test_services import submit

pytestmark = pytest.mark.django_db

RULES = {
    "queue_expired": Liveness.queue_expired,
    "offer_lapsed": Liveness.offer_lapsed,
    "stalled": Liveness.stalled,
    "unstarted_since": Liveness.unstarted_since,
    "past_deadline": Liveness.past_deadline,
}
EXPIRED, STALLED, UNSTARTED, OVERDUE = (
    "not claimed in time",
    "no token for 20 seconds",
    "no first token within its start bound",
    "still running at its deadline",
)


@pytest.fixture(autouse=True)
def _clocks(settings, serving_host) -> None:
    settings.QUEUE_TIMEOUT_SECONDS = 60
    settings.STALL_SECONDS = 20
    settings.JOB_START_FLOOR_SECONDS = 20
    settings.JOB_PROGRESS_SILENCE_SECONDS = 20
    settings.JOB_START_ALLOWANCE_SECONDS = 120
    settings.CONTINUATION_GRACE_SECONDS = 0
    # its figures: a 5 s load, so its start bound is about 25 s quiet and 35 s reporting progress
    Qualification.objects.filter(host=serving_host.host).update(load_ms=5_000)


@dataclass(frozen=True)
class JobState:
    name: str
    status: str  # queued, running (claimed by the serving host) or completed
    ago: dict[str, float | None]  # a time column: seconds before now (negative: after), None: unset
    rules: frozenset[str]  # the `Liveness` rules that hold
    verdict: str  # the fail_reason the watchdog ends it with; "": it is left alone
    offered: bool = field(default=False)  # offered to the serving host

    def __str__(self) -> str:
        return self.name


def state(name: str, status: str, ago: dict, rules: set[str], verdict: str = "", *, offered: bool = False) -> JobState:
    return JobState(name, status, ago, frozenset(rules), verdict, offered)


STREAMING = {"claimed_at": 30, "first_token_at": 25, "last_token_at": 1}
STALLED_STREAM = {"claimed_at": 60, "first_token_at": 50, "last_token_at": 25}
SILENT_START = {"claimed_at": 30, "last_token_at": 30}

STATES = [
    state("queued, offered", "queued", {"created_at": 5, "offer_until": -5}, set(), offered=True),
    state("queued, never offered", "queued", {"created_at": 5, "offer_until": None}, {"offer_lapsed"}),
    state("queued, its offer lapsed", "queued", {"created_at": 10, "offer_until": 5}, {"offer_lapsed"}, offered=True),
    state("queued just inside the timeout", "queued", {"created_at": 55, "offer_until": -5}, set(), offered=True),
    state(
        "queued past the timeout, offered",
        "queued",
        {"created_at": 65, "offer_until": -5},
        {"queue_expired"},
        EXPIRED,
        offered=True,
    ),
    state(
        "queued past the timeout, its offer lapsed",
        "queued",
        {"created_at": 65, "offer_until": 5},
        {"queue_expired", "offer_lapsed"},
        EXPIRED,
        offered=True,
    ),
    state("streaming", "running", STREAMING, set()),
    state("quiet inside the stall clock", "running", {**STREAMING, "last_token_at": 15}, set()),
    state("stalled", "running", STALLED_STREAM, {"stalled"}, STALLED),
    state("just claimed", "running", {"claimed_at": 5, "last_token_at": 5}, set()),
    state("silent past its start bound", "running", SILENT_START, {"unstarted_since"}, UNSTARTED),
    state(
        "loading past its start bound, reporting progress",
        "running",
        {**SILENT_START, "progress_at": 3},
        {"unstarted_since"},
    ),
    state(
        "loading past the start allowance, reporting progress",
        "running",
        {"claimed_at": 125, "last_token_at": 125, "progress_at": 1},
        {"unstarted_since"},
        UNSTARTED,
    ),
    state("streaming past its deadline", "running", {**STREAMING, "deadline_at": 1}, {"past_deadline"}, OVERDUE),
    state(
        "stalled past its deadline",
        "running",
        {**STALLED_STREAM, "deadline_at": 1},
        {"stalled", "past_deadline"},
        STALLED,
    ),
    state(
        "silent past its start bound and its deadline",
        "running",
        {**SILENT_START, "deadline_at": 1},
        {"unstarted_since", "past_deadline"},
        UNSTARTED,
    ),
    state(
        "loading, reporting progress, past its deadline",
        "running",
        {**SILENT_START, "progress_at": 3, "deadline_at": 1},
        {"unstarted_since", "past_deadline"},
        OVERDUE,
    ),
    state(
        "completed long ago",
        "completed",
        {"claimed_at": 600, "first_token_at": 590, "last_token_at": 500, "deadline_at": 300, "finished_at": 500},
        set(),
    ),
]


def job_in(job_state: JobState, *, customer, catalog, serving_host, now: datetime) -> Job:
    request = submit(customer, catalog)
    if job_state.status == "queued":
        job = request.jobs.get()
    else:
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    times = {column: None if ago is None else now - timedelta(seconds=ago) for column, ago in job_state.ago.items()}
    Job.objects.filter(pk=job.pk).update(
        **times,
        offered_host=serving_host.host if job_state.offered else None,
        **({"status": job_state.status} if job_state.status == "completed" else {}),
    )
    return Job.objects.get(pk=job.pk)


class LivenessRuleTests:
    @pytest.mark.parametrize("job_state", STATES, ids=str)
    def test_each_rule_holds_exactly_the_jobs_it_names(
        self, customer, catalog, serving_host, job_state: JobState
    ) -> None:
        """As the sweeps ask (a filter over every job) and as `request_watch` asks (the rules
        annotated on its one job)."""
        now = timezone.now()
        job = job_in(job_state, customer=customer, catalog=catalog, serving_host=serving_host, now=now)
        for name, rule in RULES.items():
            expected = {job.pk} if name in job_state.rules else set()
            assert set(Job.objects.filter(rule(now)).values_list("pk", flat=True)) == expected, name
        asked = (
            Job.objects.filter(pk=job.pk)
            .annotate(
                **{name: ExpressionWrapper(rule(now), output_field=BooleanField()) for name, rule in RULES.items()}
            )
            .values(*RULES)
            .get()
        )
        assert {name for name, holds in asked.items() if holds} == job_state.rules

    @pytest.mark.parametrize("job_state", [s for s in STATES if s.status == "queued"], ids=str)
    def test_a_reoffer_goes_out_exactly_when_the_offer_lapsed(
        self, customer, catalog, serving_host, outsider, job_state: JobState
    ) -> None:
        """`job_reoffer` (the stream's step for `offer_lapsed`) re-offers a lapsed offer to
        another warm host, and leaves a live one alone."""
        job = job_in(job_state, customer=customer, catalog=catalog, serving_host=serving_host, now=timezone.now())
        Host.objects.filter(pk=outsider.host.pk).update(last_heartbeat_at=timezone.now())
        offered = services.job_reoffer(job_id=job.pk)
        assert offered == (outsider.host.pk if "offer_lapsed" in job_state.rules else None)


def outcome(act: Callable[[], object], job_id: int) -> tuple[str, str]:
    """What `act` leaves of the job (its status and why it failed), then undone."""
    with transaction.atomic():
        act()
        ended = Job.objects.filter(pk=job_id).values_list("status", "fail_reason").get()
        transaction.set_rollback(True)
    return ended


class VerdictTests:
    @pytest.mark.parametrize("job_state", STATES, ids=str)
    def test_the_sweeps_and_request_watch_reach_the_same_verdict(
        self, customer, catalog, serving_host, job_state: JobState
    ) -> None:
        job = job_in(job_state, customer=customer, catalog=catalog, serving_host=serving_host, now=timezone.now())
        swept = outcome(services.watchdog_tick, job.pk)
        watched = outcome(lambda: services.request_watch(request_id=job.request_id), job.pk)
        expected = ("failed", job_state.verdict) if job_state.verdict else (job_state.status, "")
        assert swept == expected
        assert watched == expected
