"""A host takes a job: the routed claim (one compare-and-set that marks the job running and
its request started, in raw SQL because it runs for every job), the payload the host
receives (the work and nothing about the customer), and the check every later call of the
host's makes that the job is still its own and running.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import cast

from django.db import connection, transaction
from django.db.models import JSONField
from django.utils import timezone
from django.utils.crypto import salted_hmac

from catalog.models import CatalogModel
from catalog.rendering import chat_format_of, render_instant
from core.events import announce_on_commit, request_group
from hosts.models import ACCEPTING, TRUSTED, Host, claim_cap_sql
from hosts.selectors import qualified_model_ids, warm_model_ids
from marketplace.lifecycle.answers import count_output
from marketplace.lifecycle.errors import HostRefused, JobNotRunning
from marketplace.models import CHOICE_OF, Job, Request
from marketplace.trust import routing
from marketplace.trust.audits import job_seed
from marketplace.trust.prefixes import prefix_record
from protocol.jobs import JobPayload, job_payload_build


def prompt_cache_key(*, user_id: int | None, host_id: int) -> str:
    """The opaque key under which a host may reuse a job's prompt KV for another job: one per
    account and host (a keyed hash: the host learns nothing about the account, and no other host
    can link it). Two accounts never share a held prompt, so a quicker first token tells no
    account what another sent."""
    return salted_hmac("elephant.prompt-cache", f"{user_id}:{host_id}").hexdigest()[:32]


def job_payload(job: Job, *, cache_key: str = "") -> JobPayload:
    """What a host receives (`protocol.jobs`): the work, and nothing about the customer.
    A continuation carries what was already delivered before it, counted by the gateway (the
    same payload at its claim and at its settlement, when its audit rebuilds it: its own text
    is left out). Every chat and completion job carries its sampling seed
    (`marketplace.trust.audits.job_seed`). `cache_key` (`prompt_cache_key`): only the claiming
    host is given one; an audit's copy of the payload has none."""
    request = job.request
    continuation = job.attempt > 1 and request.kind != Request.Kind.EMBEDDINGS
    delivered = request.delivered_text if continuation else ""
    delivered = delivered[: len(delivered) - job.generated_chars]
    fmt = None if request.kind == Request.Kind.EMBEDDINGS else chat_format_of(job.model_id)
    params = (
        request.params
        if request.kind == Request.Kind.EMBEDDINGS
        else {  # (which choice it is is the gateway's)
            **{k: v for k, v in request.params.items() if k != CHOICE_OF},
            "seed": job_seed(job_id=job.pk, params=request.params),
        }
    )
    return job_payload_build(
        job_id=job.pk,
        model=job.model.name,
        kind=request.kind,
        messages=request.messages,
        prompt=request.prompt,
        inputs=request.inputs,
        params=params,
        fmt=fmt,
        continuation=continuation,
        delivered=delivered,
        delivered_tokens=count_output(request, delivered),
        now=render_instant(request.params),
        cache_key=cache_key,
    )


_CLAIMED_REQUEST_COLUMNS = (
    "public_id",
    "kind",
    "messages",
    "prompt",
    "inputs",
    "params",
    "model_id",
    "user_id",
    "prefix_hashes",
)


_JSON_COLUMNS = ("messages", "inputs", "params", "prefix_hashes")


def job_claim_next(
    *,
    host: Host,
    fingerprint: str = "",
    model_ids: list[int] | None = None,
    warm_ids: list[int] | None = None,
    boot: str = "",
) -> Job | None:
    """Give the host the next queued job routing lets it take, if any.

    `model_ids` (the host's qualified models) and `warm_ids` (those it has loaded, see
    `routing.warm_model_ids`), looked up once per long-poll, may be passed instead of
    the fingerprint. Jobs offered to this host come first; jobs offered to another host
    wait for that offer to lapse; a host without the model loaded waits out the cold
    grace; a continuation skips the host whose attempt died until its grace is over
    (`routing.claim_sql`). `boot`: the claiming process's boot id, kept on the job
    (`failover.host_boot_seen`).
    """
    job = _claim_routed(host=host, fingerprint=fingerprint, model_ids=model_ids, warm_ids=warm_ids, boot=boot)
    return None if job is None else Job.objects.select_related("request", "model").get(pk=job.pk)


def job_claim_payload(
    *,
    host: Host,
    model_ids: list[int],
    warm_ids: list[int] | None = None,
    boot: str = "",
) -> JobPayload | None:
    """`job_claim_next`, rendered as what the host receives (the long-poll's path: no
    read after the claim; the prompt's blocks are recorded as this host's, `trust.prefixes`).
    `warm_ids` may be looked up once per long-poll."""
    job = _claim_routed(host=host, model_ids=model_ids, warm_ids=warm_ids, boot=boot)
    if job is None:
        return None
    request = job.request
    prefix_record(user_id=request.user_id, model_id=job.model_id, host_id=host.pk, hashes=request.prefix_hashes)
    return job_payload(job, cache_key=prompt_cache_key(user_id=job.request.user_id, host_id=host.pk))


def _claim_routed(
    *,
    host: Host,
    fingerprint: str = "",
    model_ids: list[int] | None,
    warm_ids: list[int] | None,
    boot: str = "",
) -> Job | None:
    if model_ids is None:
        model_ids = qualified_model_ids(host=host, fingerprint=fingerprint)
    if not model_ids:
        return None
    now = timezone.now()
    if warm_ids is None:
        warm_ids = warm_model_ids(host=host, model_ids=model_ids, now=now)
    selection = routing.claim_sql(host_id=host.pk, model_ids=model_ids, warm_ids=warm_ids, now=now)
    loaded_ids = warm_ids if host.catalog_fresh(now) else []  # said loaded, not merely possibly warm
    return job_claim_selected(host=host, selection=selection, now=now, boot=boot, loaded_ids=loaded_ids)


def job_claim_selected(
    *,
    host: Host,
    selection: tuple[str, list],
    now: datetime,
    boot: str = "",
    loaded_ids: Sequence[int] = (),
) -> Job | None:
    """Claim the first job of `selection` (SQL conditions on the job table and an ORDER BY,
    with their parameters) unless the host is paused or in maintenance: mark it running
    and its request started. Returns the job as far as `job_payload` reads it (built
    from what the statement returned, not read again; `job_claim_next` reads the row).
    `loaded_ids`: the models the host's fresh catalog says it has loaded; a job of one of
    them is `loaded_at_claim` (its start bound is its prefill, `watchdog.job_start_bounds`).

    The UPDATE re-checks `status`, so two hosts can never both win a job; on PostgreSQL
    the pick is FOR UPDATE SKIP LOCKED, so many hosts claim at once without queueing
    behind each other (SQLite serialises writers), while one host's own claims queue on its
    row (its claim cap holds under races). On PostgreSQL it is one round trip: the host's
    row lock, then one statement (the request's update reads the job's in a CTE).
    Elsewhere, two statements in one transaction. Plain SQL: this runs for every job,
    and the ORM's statement building and reading back cost more than the work.
    """
    conditions, params = selection
    job_table, request_table, host_table, model_table = (
        connection.ops.quote_name(model._meta.db_table) for model in (Job, Request, Host, CatalogModel)
    )
    skip_locked = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    at = connection.ops.adapt_datetimefield_value(now)
    # The host, read in the statement (never from a stale copy), by the rules in `hosts.models`:
    # accepting work (not banned, in maintenance or paused); below its claim cap (slots, bounded
    # by probation or trust); trusted, or the job did not ask for trusted hosts.
    accepting, accepting_params = ACCEPTING.sql(alias="h")
    cap, cap_params = claim_cap_sql(alias="h")
    trusted, trusted_params = TRUSTED.sql(alias="t")
    host_ok = (
        f"EXISTS (SELECT 1 FROM {host_table} h WHERE h.id = %s AND {accepting}"
        f" AND (SELECT COUNT(*) FROM {job_table} r WHERE r.host_id = h.id AND r.status = %s) < {cap})"
        f" AND (trusted_only = %s OR EXISTS (SELECT 1 FROM {host_table} t WHERE t.id = %s AND {trusted}))"
    )
    host_ok_params = [
        host.pk,
        *accepting_params,
        Job.Status.RUNNING,
        *cap_params,
        False,
        host.pk,
        *trusted_params,
    ]
    loaded = f"model_id IN ({', '.join(['%s'] * len(loaded_ids))})" if loaded_ids else "%s"
    claim_job = (
        f"UPDATE {job_table} SET status = %s, host_id = %s, claimed_at = %s, last_token_at = %s, boot = %s,"
        f" loaded_at_claim = {loaded}"
        f" WHERE status = %s AND id = (SELECT id FROM {job_table} WHERE {host_ok}"
        f" AND {conditions} LIMIT 1{skip_locked})"
        " RETURNING id, attempt, request_id"
    )
    claim_params = [
        Job.Status.RUNNING,
        host.pk,
        at,
        at,
        boot,
        *(list(loaded_ids) or [False]),
        Job.Status.QUEUED,
        *host_ok_params,
        *params,
    ]
    # a continuation's request is already running: it keeps its status and start time
    start_request = (
        f"UPDATE {request_table} SET status = CASE WHEN status = %s THEN %s ELSE status END,"
        " started_at = CASE WHEN status = %s THEN %s ELSE started_at END"
    )
    start_params = [Request.Status.QUEUED, Request.Status.RUNNING, Request.Status.QUEUED, at]
    returning = ", ".join(
        [
            *(f"{request_table}.{column}" for column in _CLAIMED_REQUEST_COLUMNS),
            f"(SELECT name FROM {model_table} WHERE id = {request_table}.model_id)",
            f"(SELECT tokenizer FROM {model_table} WHERE id = {request_table}.model_id)",
        ]
    )
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # The host's row is locked first, in the same trip (two statements of one simple query
            # run as one transaction, each with its own snapshot): a host's claims queue on it, so
            # two claims at the same instant cannot both count one slot as free.
            cursor.execute(
                f"SELECT id FROM {host_table} WHERE id = %s FOR UPDATE;"
                f" WITH claimed AS ({claim_job}) {start_request} FROM claimed"
                f" WHERE {request_table}.id = claimed.request_id"
                f" RETURNING claimed.id, claimed.attempt, claimed.request_id, {returning}",
                [host.pk, *claim_params, *start_params],
            )
            cursor.nextset()
            row = cursor.fetchone()
        else:
            with transaction.atomic():
                cursor.execute(claim_job, claim_params)
                job_row = cursor.fetchone()
                if job_row is None:
                    return None
                cursor.execute(f"{start_request} WHERE id = %s RETURNING {returning}", [*start_params, job_row[2]])
                row = (*job_row, *cursor.fetchone())
    if row is None:
        return None
    job_id, attempt, request_id, *request_values, model_name, tokenizer = row
    fields = dict(zip(_CLAIMED_REQUEST_COLUMNS, request_values, strict=True))
    for column in _JSON_COLUMNS:
        field = cast(JSONField, Request._meta.get_field(column))  # (a column of _JSON_COLUMNS)
        # (the column itself, so no expression; django-stubs want one)
        fields[column] = field.from_db_value(fields[column], None, connection)  # type: ignore[arg-type]
    model = CatalogModel(pk=fields.pop("model_id"), name=model_name, tokenizer=tokenizer)
    request = Request(pk=request_id, model=model, **fields)
    announce_on_commit(request_group(request.public_id), {"type": "job.claimed"})
    return Job(pk=job_id, attempt=attempt, request=request, model=model, host=host, status=Job.Status.RUNNING)


def locked_job_of(*, host: Host, job_id: int) -> Job:
    job = Job.objects.select_for_update().select_related("request", "model").filter(pk=job_id).first()
    return check_running(job, host=host, job_id=job_id)


def check_running(job: Job | None, *, host: Host, job_id: int) -> Job:
    if job is None or job.host_id != host.pk:
        raise HostRefused("This job is not yours.", code="not_your_job")
    if job.status != Job.Status.RUNNING:
        raise JobNotRunning(f"Job {job_id} is {job.status}; stop working on it.")
    return job
