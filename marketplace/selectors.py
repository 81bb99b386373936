"""Reads of requests and jobs: the catalog as served, request state, host status and
earnings, customer usage."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing import selectors as billing
from catalog.models import CatalogModel
from core.dates import day_bounds
from core.http import holds_nul
from hosts import selectors as hosts
from hosts.models import Host
from marketplace.logprobs import located
from marketplace.models import Audit, Job, Request, StageShare

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from accounts.models import ApiKey


@dataclass(frozen=True)
class ServedModel:
    model: CatalogModel
    hosts_online: int
    hosts_warm: int


def served_models() -> list[ServedModel]:
    """The one catalog callers see: every active model at least one online host
    (or a ring's bridge, which is a host) serves, with how many hosts are warm.
    Read through a cache refreshed at the heartbeat cadence (`MODEL_LIST_CACHE_SECONDS`)."""
    cached = cache.get(SERVED_MODELS_CACHE_KEY)
    if cached is not None:
        return cached
    counts = hosts.warm_host_counts()
    served = [
        ServedModel(model=model, hosts_online=counts[model.pk]["online"], hosts_warm=counts[model.pk]["warm"])
        for model in CatalogModel.objects.filter(pk__in=list(counts)).order_by("name")
    ]
    cache.set(SERVED_MODELS_CACHE_KEY, served, settings.MODEL_LIST_CACHE_SECONDS)
    return served


SERVED_MODELS_CACHE_KEY = "marketplace.served_models"


def request_for_user(*, user: User, public_id: str, api_key: ApiKey | None = None) -> Request | None:
    """The user's request with that id; with `api_key`, only if that key made it (a key that
    is not account-wide reads its own requests only)."""
    if holds_nul(public_id):  # names no request (and the database cannot compare with it)
        return None
    rows = Request.objects.select_related("model").filter(user=user, public_id=public_id)
    return (rows.filter(api_key=api_key) if api_key is not None else rows).first()


def later_choices(row: Request) -> list[Request]:
    """The later choices of an `n` request whose first choice is `row` (none for most)."""
    return list(Request.objects.filter(user_id=row.user_id, params__choice_of=row.public_id).order_by("pk"))


def request_settled(row: Request, *, later: list[Request] = ()) -> bool:  # type: ignore[assignment]
    """Whether a request's money is final: it ended, and no audit of its answer (or of a later
    choice's) is still pending. An audited request settles when its audit is decided: until
    then its cost may be refunded, and its rendered prompt waits in the audit row for its
    scorers (`Audit`), deleted with the decision; no prompt byte outlives settlement."""
    if any(each.status not in (Request.Status.COMPLETED, Request.Status.FAILED) for each in (row, *later)):
        return False  # (an `n` request's choices run side by side: its cost is final once all have ended)
    return not Audit.objects.filter(
        request_id__in=[row.pk, *(each.pk for each in later)], status=Audit.Status.PENDING
    ).exists()


def request_state(*, public_id: str) -> Request:
    """The fields a listener needs to reconcile what it streamed with the truth."""
    return Request.objects.select_related("model").get(public_id=public_id)


def request_catch_up(*, public_id: str, sent: int) -> tuple[Request, str]:
    """The request's state and the delivered text from character `sent` on: the chunks
    that end after it (the first one cut), so a listener that missed messages gets
    exactly what it has not sent."""
    request, text, _ = request_catch_up_entries(public_id=public_id, sent=sent, logprobs=False)
    return request, text


def request_catch_up_entries(
    *, public_id: str, sent: int, logprobs: bool
) -> tuple[Request, str, list[tuple[int, dict]]]:
    """`request_catch_up`, and (when `logprobs`) the entries of the tokens that start at
    character `sent` or after, each with its offset."""
    request = request_state(public_id=public_id)
    if request.delivered_chars <= sent:
        return request, "", []
    columns = ("char_offset", "text", "logprobs") if logprobs else ("char_offset", "text")
    chunks = request.chunks.order_by("char_offset").values_list(*columns)
    later = list(chunks.filter(char_offset__gte=sent))
    head = chunks.filter(char_offset__lt=sent).last()
    if head is not None and head[0] + len(head[1]) > sent:
        later.insert(0, head)
    text = "".join(chunk[1] for chunk in later)[max(0, sent - later[0][0]) :] if later else ""
    entries = (
        [
            (at, entry)
            for chunk in later
            if len(chunk) > 2 and chunk[2]
            for at, entry in located(chunk[0], chunk[2])
            if at >= sent
        ]
        if logprobs
        else []
    )
    return request, text, entries


def unix(ts: datetime | None) -> int:
    return int((ts or timezone.now()).timestamp())


# --- hosts as the marketplace sees them ---------------------------------------------------


def with_running_job(queryset: QuerySet[Host]) -> QuerySet[Host]:
    """Annotate `has_running_job`, so a page listing many hosts gets their statuses in one query."""
    return queryset.annotate(has_running_job=Exists(Job.objects.filter(host=OuterRef("pk"), status=Job.Status.RUNNING)))


def host_status(*, host: Host) -> str:
    """banned, maintenance, paused, offline, busy or online: the first that applies. A host
    online by the one rule (`Host.is_online`) is busy or online; any other is named by the
    first part of the rule it fails. A host from `with_running_job` is busy by its
    annotation; any other costs a query."""
    not_online = host.not_online_because(timezone.now())
    if not_online is not None:
        return not_online
    running = getattr(host, "has_running_job", None)
    if running is None:
        running = Job.objects.filter(host=host, status=Job.Status.RUNNING).exists()
    if running:
        return "busy"
    return "online"


def host_active_jobs(*, host: Host) -> list[Job]:
    return list(Job.objects.filter(host=host, status=Job.Status.RUNNING).select_related("model"))


@dataclass(frozen=True)
class HostStatement:
    """A host's earnings: its money side (billing's) and its latest completed jobs (with
    `ring` and `layers` set on a line that is a ring stage's share of a job)."""

    payouts: billing.HostPayouts
    jobs: list[dict]
    verifying_ucents: int = 0  # earned on jobs whose audit is pending: paid when it passes (`marketplace.trust.audits`)


def host_statement(*, host: Host, limit: int = 100) -> HostStatement:
    """The one read behind both earnings endpoints (never who asked)."""
    jobs = [
        {**job, "ring": None, "layers": None}
        for job in Job.objects.filter(host=host, status=Job.Status.COMPLETED)
        .order_by("-finished_at", "-pk")
        .values("pk", "model__name", "completion_tokens", "earned_ucents", "finished_at")[:limit]
    ]
    stages = [  # a ring's stage host: its share of each job for the layers it ran
        {
            "pk": share["job_id"],
            "model__name": share["job__model__name"],
            "completion_tokens": share["job__completion_tokens"],
            "earned_ucents": share["earned_ucents"],
            "finished_at": share["finished_at"],
            "ring": share["plan_id"],
            "layers": f"{share['layers']}/{share['n_layers']}",
        }
        for share in StageShare.objects.filter(host=host)
        .order_by("-finished_at", "-pk")
        .values(
            "job_id",
            "job__model__name",
            "job__completion_tokens",
            "earned_ucents",
            "finished_at",
            "plan_id",
            "layers",
            "n_layers",
        )[:limit]
    ]
    lines = sorted(jobs + stages, key=lambda line: (line["finished_at"], line["pk"]), reverse=True)[:limit]
    verifying = (
        Audit.objects.filter(host=host, status=Audit.Status.PENDING).aggregate(total=Sum("host_ucents"))["total"] or 0
    )
    return HostStatement(
        payouts=billing.host_payouts(host=host, limit=limit), jobs=lines, verifying_ucents=int(verifying)
    )


def host_earned_since(*, host: Host, since: datetime) -> int:
    """µ¢ this host earned from work finished since `since`: its own jobs and its ring stages' shares."""
    own = (
        Job.objects.filter(host=host, status=Job.Status.COMPLETED, finished_at__gte=since).aggregate(
            total=Sum("earned_ucents")
        )["total"]
        or 0
    )
    stages = (
        StageShare.objects.filter(host=host, finished_at__gte=since).aggregate(total=Sum("earned_ucents"))["total"] or 0
    )
    return int(own) + int(stages)


# --- customer usage ---------------------------------------------------------------------


class UnknownCursor(LookupError):
    """An `after` cursor that names none of this user's requests."""


def usage_requests(
    *, user: User, start: date, end: date, after: str | None = None, api_key: ApiKey | None = None
) -> QuerySet[Request, Mapping[str, Any]]:
    """The user's requests created from `start` to `end` inclusive (UTC days), oldest first
    (with `api_key`, that key's only); with `after` (a request id of theirs), only those that
    come after it in that order."""
    lower, upper = day_bounds(start, end)
    rows = Request.objects.filter(user=user, created_at__gte=lower, created_at__lt=upper)
    if api_key is not None:
        rows = rows.filter(api_key=api_key)
    if after:
        if holds_nul(after):
            raise UnknownCursor(after)
        cursor = Request.objects.filter(user=user, public_id=after).values("created_at", "pk").first()
        if cursor is None:
            raise UnknownCursor(after)
        rows = rows.filter(
            Q(created_at__gt=cursor["created_at"]) | Q(created_at=cursor["created_at"], pk__gt=cursor["pk"])
        )
    return rows.order_by("created_at", "pk").values(
        "public_id",
        "created_at",
        "status",
        "model__name",
        "api_key__prefix",
        "prompt_tokens",
        "completion_tokens",
        "cost_ucents",
        "cached_tokens",
    )


def usage_daily(*, user: User, start: date, end: date, api_key: ApiKey | None = None) -> list[Mapping[str, Any]]:
    """Per UTC day: requests, tokens (the cached part of the prompts too) and cost (failed requests cost 0);
    with `api_key`, that key's."""
    lower, upper = day_bounds(start, end)
    scope = {"api_key": api_key} if api_key is not None else {}
    rows = (
        Request.objects.filter(user=user, created_at__gte=lower, created_at__lt=upper, **scope)
        .annotate(day=TruncDate("created_at", tzinfo=UTC))
        .values("day")
        .annotate(
            requests=Count("pk"),
            prompt_tokens=Sum("prompt_tokens"),
            cached_tokens=Sum("cached_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cost_ucents=Sum("cost_ucents"),
        )
        .order_by("day")
    )
    return list(rows)
