"""Liveness: the rules that say a queued job waited too long, a stream stopped, an attempt
never started or outlived its deadline, and the small steps Celery beat runs over every
job (`watchdog_tick`) and a quiet stream runs over its own request (`request_watch`).
Each rule is one `Q` in `marketplace.models.Liveness`; the verdicts end attempts through
`failover`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import BooleanField, ExpressionWrapper, Q, Sum
from django.utils import timezone

from hosts.models import Qualification
from marketplace.lifecycle.failover import attempt_end_dead
from marketplace.lifecycle.presence import request_abandon, request_forget_output
from marketplace.lifecycle.queueing import job_reoffer, request_expire_unclaimed
from marketplace.models import Job, Liveness, Request
from protocol.jobs import rewrites_delivered

PROGRESS_STRETCH = 3  # progress reports buy at most this many times what the host's own figures say a start takes


def job_start_figures_seconds(*, job: Job) -> float:
    """What the host's own benchmark says this job needs before its first token: loading
    the model, its first-token latency, and the prompt at its prompt tokens/s. A
    continuation's delivered text (a character counted as a token at most) is prompt too,
    except under a `response_format`: then the host writes it again under the grammar
    (`protocol.jobs`, `rewrite`), a token a step, unstreamed, at its generation tokens/s. 0
    without figures.

    A host whose fresh catalog said the model was loaded when it claimed (`loaded_at_claim`,
    its heartbeat's word, at most CATALOG_STALE_SECONDS old) has nothing to load: its figures
    are its prefill alone, so a frozen warm host cannot hold a blank stream for its load time
    (issue 50). A host cold at its claim, or whose catalog could not be read, keeps its load."""
    assert job.host_id is not None  # a claimed job has its host (the claimed_job_has_host constraint)
    figures = (
        Qualification.objects.filter(host_id=job.host_id, model_id=job.model_id)
        .order_by("-updated_at")
        .values_list("load_ms", "ttft_ms", "prompt_tps", "gen_tps")
        .first()
    )
    if figures is None:
        return 0.0
    load_ms, ttft_ms, prompt_tps, gen_tps = figures
    if job.loaded_at_claim:
        load_ms = 0
    fed, delivered, params = (
        Request.objects.filter(pk=job.request_id).values_list("prompt_tokens", "delivered_chars", "params").get()
    )
    rewritten = 0
    if job.attempt > 1:  # a continuation: its delivered text is prompt, or written again
        if rewrites_delivered(params or {}):
            rewritten = delivered
        else:
            fed += delivered
    fed += _prompts_ahead(job=job)
    return (
        (load_ms + ttft_ms) / 1000
        + (fed / prompt_tps if prompt_tps > 0 else 0)
        + (rewritten / gen_tps if gen_tps > 0 else 0)
    )


def _prompts_ahead(*, job: Job) -> int:
    """The prompt tokens of the host's other jobs claimed before this one and not started when
    it was claimed: a host serving several jobs at once reads their prompts before or beside
    this one's (none on a host with one slot)."""
    if job.claimed_at is None:
        return 0
    assert job.host_id is not None  # claimed, so it has its host
    ahead = (
        Job.objects.filter(host_id=job.host_id, status=Job.Status.RUNNING, claimed_at__lte=job.claimed_at)
        .exclude(pk=job.pk)
        .filter(Q(first_token_at__isnull=True) | Q(first_token_at__gt=job.claimed_at))
    )
    return int(Request.objects.filter(jobs__in=ahead).aggregate(total=Sum("prompt_tokens"))["total"] or 0)


def job_start_bounds(*, job: Job) -> tuple[float, float]:
    """How long the host may take to its first token: (without a word, while it reports
    progress). Without a word: its own figures (`job_start_figures_seconds`: a warm host's
    are its prefill for this prompt, a cold one's its load too) plus the small
    JOB_START_FLOOR_SECONDS. Reporting progress: the floor plus PROGRESS_STRETCH times its
    figures (a cold disk, a busy machine, other slots prefilling), so a host whose figures say
    it starts at once cannot buy a blank minute with progress reports. Both at most
    JOB_START_ALLOWANCE_SECONDS: the benchmark is the host's word, and the allowance
    bounds what a lie can buy."""
    figures, floor, cap = (
        job_start_figures_seconds(job=job),
        settings.JOB_START_FLOOR_SECONDS,
        settings.JOB_START_ALLOWANCE_SECONDS,
    )
    return min(floor + figures, cap), min(floor + PROGRESS_STRETCH * figures, cap)


def job_start_overdue(*, job: Job, now: datetime) -> bool:
    """Whether a running attempt that has sent no token yet is dead (seed 001: before the
    first token a loading or prefilling host has a bounded deadline, not the stall clock):
    past its quiet bound with no progress report for JOB_PROGRESS_SILENCE_SECONDS, or past
    its stretched bound whatever it reports (`job_start_bounds`)."""
    if job.claimed_at is None or job.first_token_at is not None:
        return False
    since_claim = (now - job.claimed_at).total_seconds()
    if since_claim <= settings.JOB_START_FLOOR_SECONDS:  # (no bound is shorter: spare the queries)
        return False
    quiet, stretched = job_start_bounds(job=job)
    silent = (now - (job.progress_at or job.claimed_at)).total_seconds()
    return since_claim > stretched or (since_claim > quiet and silent > settings.JOB_PROGRESS_SILENCE_SECONDS)


def job_stalled_end(*, job_id: int, ended: bool = False) -> str:
    """A running attempt produced nothing for STALL_SECONDS, or (`ended`: its text said the
    answer ended) no "complete" for COMPLETE_GRACE_SECONDS: its host is presumed dead."""
    if ended:
        return attempt_end_dead(
            job_id=job_id, reason=f"no complete within {settings.COMPLETE_GRACE_SECONDS:g} seconds of its last batch"
        )
    return attempt_end_dead(job_id=job_id, reason=f"no token for {settings.STALL_SECONDS:g} seconds")


def job_unstarted_end(*, job_id: int) -> str:
    """A running attempt overran its start bound with no token (`job_start_overdue`): it
    goes back to the queue (it delivered nothing)."""
    return attempt_end_dead(job_id=job_id, reason="no first token within its start bound")


def job_overdue_end(*, job_id: int) -> str:
    """A running attempt outlived its deadline (`job_limits`): however it trickles, it ends."""
    return attempt_end_dead(job_id=job_id, reason="still running at its deadline")


def request_watch(*, request_id: int) -> None:
    """Apply the watchdog rules to one request (its stream calls this while quiet): the
    `Liveness` rules asked of its live job in one query, in the order the sweeps apply them."""
    now = timezone.now()
    job = (
        Job.objects.filter(request_id=request_id, status__in=[Job.Status.QUEUED, Job.Status.RUNNING])
        .annotate(
            expired=ExpressionWrapper(Liveness.queue_expired(now), output_field=BooleanField()),
            lapsed=ExpressionWrapper(Liveness.offer_lapsed(now), output_field=BooleanField()),
            stalled=ExpressionWrapper(Liveness.stalled(now), output_field=BooleanField()),
            overdue=ExpressionWrapper(Liveness.past_deadline(now), output_field=BooleanField()),
        )
        .first()
    )
    if job is None:
        return
    if job.expired:
        request_expire_unclaimed(request_id=request_id)
    elif job.lapsed:
        job_reoffer(job_id=job.pk)
    elif job.status == Job.Status.RUNNING and job.first_token_at is None and job_start_overdue(job=job, now=now):
        job_unstarted_end(job_id=job.pk)
    elif job.stalled:
        job_stalled_end(job_id=job.pk, ended=bool(job.text_end))
    elif job.overdue:
        job_overdue_end(job_id=job.pk)


def unclaimed_request_expire_one() -> bool:
    job = Job.objects.filter(Liveness.queue_expired(timezone.now())).order_by("created_at").first()
    return job is not None and request_expire_unclaimed(request_id=job.request_id)


def stalled_job_end_one() -> bool:
    """A stream that stopped (`Liveness.stalled`)."""
    job = Job.objects.filter(Liveness.stalled(timezone.now())).order_by("last_token_at").first()
    return job is not None and bool(job_stalled_end(job_id=job.pk, ended=bool(job.text_end)))


def unstarted_job_end_one() -> bool:
    """An attempt that overran its start bound with no token (`job_start_overdue`), oldest
    claims first."""
    now = timezone.now()
    for job in Job.objects.filter(Liveness.unstarted_since(now)).order_by("claimed_at")[:20]:
        if job_start_overdue(job=job, now=now):
            return bool(job_unstarted_end(job_id=job.pk))
    return False


def overdue_job_end_one() -> bool:
    job = Job.objects.filter(Liveness.past_deadline(timezone.now())).order_by("deadline_at").first()
    return job is not None and bool(job_overdue_end(job_id=job.pk))


def abandoned_request_end_one() -> bool:
    """A request whose customer went away and did not come back within the grace."""
    cutoff = timezone.now() - timedelta(seconds=settings.ABANDON_GRACE_SECONDS)
    request_id = (
        Request.objects.filter(status__in=[Request.Status.QUEUED, Request.Status.RUNNING], left_at__lt=cutoff)
        .order_by("left_at")
        .values_list("pk", flat=True)
        .first()
    )
    return request_id is not None and bool(request_abandon(request_id=request_id))


def ended_output_forget_one() -> bool:
    cutoff = timezone.now() - timedelta(seconds=settings.OUTPUT_RETENTION_SECONDS)
    request = (
        Request.objects.filter(
            status__in=[Request.Status.COMPLETED, Request.Status.FAILED], output_forgotten=False, finished_at__lt=cutoff
        )
        .only("pk")
        .first()
    )
    return request is not None and request_forget_output(request_id=request.pk)


WATCHDOG_STEPS = (
    unclaimed_request_expire_one,
    stalled_job_end_one,
    unstarted_job_end_one,
    overdue_job_end_one,
    abandoned_request_end_one,
    ended_output_forget_one,
)


def watchdog_tick(*, max_steps: int = 200) -> int:
    """Run every step until none has work left (bounded). Returns steps taken."""
    taken = 0
    for step in WATCHDOG_STEPS:
        while taken < max_steps and step():
            taken += 1
    return taken
