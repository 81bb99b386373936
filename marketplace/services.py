"""Writes for keys, requests and jobs: the request path's state machine.

Request: queued → running → completed | failed.   Job: queued → running →
completed | failed. Every transition is a compare-and-set (`filter(status=old)
.update(...)` and a check of the row count) or runs under a row lock; the loser
of a race gets a typed refusal, never a half-applied change.
"""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from accounts.models import ApiKey
from billing import services as billing
from billing.models import Hold
from catalog.models import CatalogModel
from catalog.pricing import price
from catalog.tokenizer import tokenizer_for
from core.db import ChainMissed, Step, chain_run, insert_step
from core.errors import DomainError, bad_request
from core.events import announce_on_commit, host_group, queue_group, request_group
from hosts.models import Host, Qualification
from hosts.selectors import qualified_model_ids, warm_model_ids
from hosts.services import host_ban, host_maintenance_enter
from marketplace import reputation, routing
from marketplace.logprobs import entries_problem
from marketplace.models import Job, Request, StageShare, TextChunk
from marketplace.structured import answer_problem
from mesh.rings.models import RingPlan
from mesh.rings.selectors import ring_layers
from protocol.jobs import JobPayload, job_payload_build
from protocol.turns import render_job

# --- admission ----------------------------------------------------------------


def estimate_ucents(*, model: CatalogModel, prompt_tokens: int, max_tokens: int) -> int:
    """Upper bound of the cost: every prompt token plus every allowed output token."""
    return price(model, prompt_tokens=prompt_tokens, completion_tokens=max_tokens)


def new_public_id(kind: str) -> str:
    prefix = {Request.Kind.CHAT: "chatcmpl-", Request.Kind.EMBEDDINGS: "emb-"}.get(kind, "cmpl-")
    return prefix + secrets.token_hex(12)


def request_submit(
    *,
    public_id: str,
    api_key: ApiKey,
    model: CatalogModel,
    kind: str,
    messages: list | None,
    prompt: str | None,
    params: dict,
    stream: bool,
    prompt_tokens: int,
    inputs: list[str] | None = None,
    only_host_id: int | None = None,
    trusted_only: bool = False,
) -> Request:
    """Admit a request: hold its worst-case cost, then queue its first job (a canary's,
    `only_host_id`, for its host alone; `trusted_only`: for trusted hosts only).

    Raises InsufficientCredit / KeyLimitExceeded (→ 402) before anything is
    queued; the hold, request and job commit together or not at all. The usual
    admission is one statement chain (`_request_admit_chained`: one round trip on
    PostgreSQL); a key with limits, a refusal and a customer's first request take the
    locked path (`billing.hold_place`), which counts the limits and says why.
    """
    estimate = estimate_ucents(model=model, prompt_tokens=prompt_tokens, max_tokens=params["max_tokens"])
    request = Request(
        public_id=public_id, user=api_key.user, api_key=api_key, model=model, kind=kind, stream=stream, messages=messages,
        prompt=prompt, inputs=inputs, params=params, prompt_tokens=prompt_tokens, estimate_ucents=estimate,
    )
    limits = job_limits(request=request, model=model, now=timezone.now())  # (a process's first reads the vocabulary)
    # Routing reads before the account's row is locked: a customer's admissions queue on
    # that lock, so it is held for the writes only. The offer's clock starts here.
    placement = _placement(model=model, only_host_id=only_host_id, avoid_host_id=None, trusted_only=trusted_only)
    job = Job(request=request, model=model, trusted_only=trusted_only, only_host_id=only_host_id, **placement, **limits)
    hold = billing.hold_steps(user_id=api_key.user_id, api_key=api_key, amount_ucents=estimate)
    if hold is not None and _request_admit_chained(request=request, job=job, hold=hold):
        return request
    return _request_admit_locked(request=request, job=job)


def _request_admit_chained(*, request: Request, job: Job, hold: list[Step]) -> bool:
    """The hold, the request and its job as one chain of compare-and-sets and inserts;
    False (nothing written) when a step refused."""
    steps = [*hold, insert_step("request", request, refs={"hold_id": "hold"}), insert_step("job", job, refs={"request_id": "request"})]
    try:
        with transaction.atomic():
            ids = chain_run(steps)
            request.pk, request.hold_id, job.pk = ids["request"], ids["hold"], ids["job"]
            job.request = request
            _job_announce(job)
    except ChainMissed:
        return False
    return True


@transaction.atomic
def _request_admit_locked(*, request: Request, job: Job) -> Request:
    request.hold = billing.hold_place(user=request.user, api_key=request.api_key, amount_ucents=request.estimate_ucents)
    request.save(force_insert=True)
    job.save(force_insert=True)
    _job_announce(job)
    return request


def _placement(*, model: CatalogModel, only_host_id: int | None, avoid_host_id: int | None, trusted_only: bool) -> dict:
    if only_host_id is not None:  # a canary: offered to its host alone, for as long as it waits
        return {"offered_host_id": only_host_id, "offer_until": None, "warm_until": None}
    return routing.placement(model=model, avoid_host_id=avoid_host_id, trusted_only=trusted_only)


def job_limits(*, request: Request, model: CatalogModel, now: datetime) -> dict:
    """What no host can exceed on this job, as its row's fields: the text it may send
    (`max_tokens` of the tokenizer's longest token) and its deadline (the queue timeout, a
    start allowance for loading and prefill, and `max_tokens` at the slowest acceptable
    speed). A continuation gets the whole budget again (it regenerates the prompt)."""
    max_tokens = int(request.params.get("max_tokens") or 0)
    seconds = settings.QUEUE_TIMEOUT_SECONDS + settings.JOB_START_ALLOWANCE_SECONDS + max_tokens / settings.JOB_MIN_TOKENS_PER_SECOND
    max_chars = None
    if request.kind != Request.Kind.EMBEDDINGS:
        max_chars = max_tokens * tokenizer_for(model.tokenizer).longest_token_chars()
    return {"max_chars": max_chars, "deadline_at": now + timedelta(seconds=seconds)}


def job_queue(
    *, request: Request, model: CatalogModel, placement: dict | None = None, trusted_only: bool = False, **fields: object
) -> Job:
    """Create a request's next job already routed (one INSERT carries the routing decision,
    `placement`, decided here unless given, and the job's limits), and wake whoever may
    take it (after the commit)."""
    if placement is None:
        avoid, only = fields.get("avoid_host_id"), fields.get("only_host_id")
        placement = _placement(model=model, only_host_id=only if isinstance(only, int) else None,
                               avoid_host_id=avoid if isinstance(avoid, int) else None, trusted_only=trusted_only)
    limits = job_limits(request=request, model=model, now=timezone.now())
    job = Job.objects.create(request=request, model=model, trusted_only=trusted_only, **fields, **placement, **limits)
    _job_announce(job)
    return job


def _job_announce(job: Job) -> None:
    """Wake whoever may take a queued job, after the commit."""
    offered = job.offered_host_id
    if offered is not None:  # one host's long-polls: one of them per gateway process need look
        announce_on_commit(host_group(offered), {"type": "job.queued", "offer": f"{job.pk}.{job.requeue}"})
    else:
        announce_on_commit(queue_group(job.model_id), {"type": "job.queued"})


# --- claiming ---------------------------------------------------------------


class BadResult(DomainError):
    """What the host sent back cannot be the answer (wrong shape): nothing is settled."""

    code = "invalid_result"


class HostRefused(DomainError):
    """The host may not do this (paused, not qualified, not its job)."""

    status = 403
    code = "forbidden"


class JobNotRunning(DomainError):
    """The job already ended (or was never claimed): the host must stop."""

    status = 409
    code = "job_not_running"


class SequenceGap(DomainError):
    status = 409
    code = "sequence_gap"


class TextBoundExceeded(JobNotRunning):
    """The host sent more than the job's max_tokens allows: its attempt was ended."""

    code = "text_bound_exceeded"


def job_payload(job: Job) -> JobPayload:
    """What a host receives (`protocol.jobs`): the work, and nothing about the customer.
    A continuation carries what was already delivered, counted by the gateway."""
    request = job.request
    continuation = job.attempt > 1 and request.kind != Request.Kind.EMBEDDINGS
    delivered = request.delivered_text if continuation else ""
    return job_payload_build(
        job_id=job.pk, model=job.model.name, kind=request.kind, messages=request.messages, prompt=request.prompt,
        inputs=request.inputs, params=request.params, continuation=continuation, delivered=delivered,
        delivered_tokens=_count_output(request, delivered),
    )


# What a claim reads back of the request it started: what the host's payload needs.
_CLAIMED_REQUEST_COLUMNS = ("public_id", "kind", "messages", "prompt", "inputs", "params", "model_id")
_JSON_COLUMNS = ("messages", "inputs", "params")


def job_claim_next(
    *, host: Host, fingerprint: str = "", model_ids: list[int] | None = None, warm_ids: list[int] | None = None
) -> Job | None:
    """Give the host the next queued job routing lets it take, if any.

    `model_ids` (the host's qualified models) and `warm_ids` (those it has loaded, see
    `routing.warm_model_ids`), looked up once per long-poll, may be passed instead of
    the fingerprint. Jobs offered to this host come first; jobs offered to another host
    wait for that offer to lapse; a host without the model loaded waits out the cold
    grace; a continuation skips the host whose attempt died until its grace is over
    (`routing.claim_sql`).
    """
    job = _claim_routed(host=host, fingerprint=fingerprint, model_ids=model_ids, warm_ids=warm_ids)
    return None if job is None else Job.objects.select_related("request", "model").get(pk=job.pk)


def job_claim_payload(*, host: Host, model_ids: list[int], warm_ids: list[int] | None = None) -> dict | None:
    """`job_claim_next`, rendered as what the host receives (the long-poll's path: no
    query after the claim)."""
    job = _claim_routed(host=host, model_ids=model_ids, warm_ids=warm_ids)
    return None if job is None else job_payload(job)


def _claim_routed(
    *, host: Host, fingerprint: str = "", model_ids: list[int] | None, warm_ids: list[int] | None
) -> Job | None:
    if model_ids is None:
        model_ids = qualified_model_ids(host=host, fingerprint=fingerprint)
    if not model_ids:
        return None
    now = timezone.now()
    if warm_ids is None:
        warm_ids = warm_model_ids(host=host, model_ids=model_ids, now=now)
    selection = routing.claim_sql(host_id=host.pk, model_ids=model_ids, warm_ids=warm_ids, now=now)
    return job_claim_selected(host=host, selection=selection, now=now)


def job_claim_selected(*, host: Host, selection: tuple[str, list], now: datetime) -> Job | None:
    """Claim the first job of `selection` (SQL conditions on the job table and an ORDER BY,
    with their parameters) unless the host is paused or in maintenance: mark it running
    and its request started. Returns the job as far as `job_payload` reads it (built
    from what the statement returned, not read again; `job_claim_next` reads the row).

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
    # The host, read in the statement (never from a stale copy): not paused, in maintenance or
    # banned; below its cap (`reputation.claim_cap`: slots, bounded by probation or trust);
    # trusted, or the job did not ask for trusted hosts.
    host_ok = (
        f"NOT EXISTS (SELECT 1 FROM {host_table} h WHERE h.id = %s AND (h.paused = %s OR h.maintenance_since IS NOT NULL"
        " OR h.banned_at IS NOT NULL OR (SELECT COUNT(*) FROM {job} r WHERE r.host_id = h.id AND r.status = %s)"
        " >= CASE WHEN h.slots < (CASE WHEN h.trusted_at IS NULL THEN %s ELSE %s END) THEN h.slots"
        " ELSE (CASE WHEN h.trusted_at IS NULL THEN %s ELSE %s END) END))"
        f" AND (trusted_only = %s OR EXISTS (SELECT 1 FROM {host_table} t WHERE t.id = %s AND t.trusted_at IS NOT NULL))"
    ).replace("{job}", job_table)
    caps = [settings.HOST_PROBATION_MAX_JOBS, settings.HOST_TRUSTED_MAX_JOBS] * 2
    claim_job = (
        f"UPDATE {job_table} SET status = %s, host_id = %s, claimed_at = %s, last_token_at = %s"
        f" WHERE status = %s AND id = (SELECT id FROM {job_table} WHERE {host_ok}"
        f" AND {conditions} LIMIT 1{skip_locked})"
        " RETURNING id, attempt, request_id"
    )
    claim_params = [
        Job.Status.RUNNING, host.pk, at, at, Job.Status.QUEUED,
        host.pk, True, Job.Status.RUNNING, *caps, False, host.pk, *params,
    ]
    # a continuation's request is already running: it keeps its status and start time
    start_request = (
        f"UPDATE {request_table} SET status = CASE WHEN status = %s THEN %s ELSE status END,"
        " started_at = CASE WHEN status = %s THEN %s ELSE started_at END"
    )
    start_params = [Request.Status.QUEUED, Request.Status.RUNNING, Request.Status.QUEUED, at]
    returning = ", ".join(
        [*(f"{request_table}.{column}" for column in _CLAIMED_REQUEST_COLUMNS),
         f"(SELECT name FROM {model_table} WHERE id = {request_table}.model_id)",
         f"(SELECT tokenizer FROM {model_table} WHERE id = {request_table}.model_id)"]
    )
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # The host's row is locked first, in the same trip (two statements of one simple query
            # run as one transaction, each with its own snapshot): a host's claims queue on it, so
            # two claims at the same instant cannot both count one slot as free.
            cursor.execute(
                f"SELECT id FROM {host_table} WHERE id = %s FOR UPDATE;"
                f" WITH claimed AS ({claim_job}) {start_request} FROM claimed WHERE {request_table}.id = claimed.request_id"
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
        fields[column] = Request._meta.get_field(column).from_db_value(fields[column], None, connection)
    model = CatalogModel(pk=fields.pop("model_id"), name=model_name, tokenizer=tokenizer)
    request = Request(pk=request_id, model=model, **fields)
    announce_on_commit(request_group(request.public_id), {"type": "job.claimed"})
    return Job(pk=job_id, attempt=attempt, request=request, model=model, host=host, status=Job.Status.RUNNING)


def _locked_job_of(*, host: Host, job_id: int) -> Job:
    job = Job.objects.select_for_update().select_related("request", "model").filter(pk=job_id).first()
    return _check_running(job, host=host, job_id=job_id)


def _check_running(job: Job | None, *, host: Host, job_id: int) -> Job:
    if job is None or job.host_id != host.pk:
        raise HostRefused("This job is not yours.", code="not_your_job")
    if job.status != Job.Status.RUNNING:
        raise JobNotRunning(f"Job {job_id} is {job.status}; stop working on it.")
    return job


# --- streaming tokens -------------------------------------------------------------


MAX_BATCH_CHARS = 65536  # the most text one batch may carry, whichever door it comes through


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    next_seq: int


@dataclass(frozen=True)
class Push:
    """One batch of a job's text, as a host sent it (through either door)."""

    host: Host
    job_id: int
    seq: int
    text: str
    logprobs: list[dict] | None = None  # its tokens' entries, when the request asked for log-probabilities


def job_push_tokens(*, host: Host, job_id: int, seq: int, text: str, logprobs: list[dict] | None = None) -> PushResult:
    """Apply one ordered batch of text (see `job_push_many`); raises its refusal."""
    result = job_push_many([Push(host=host, job_id=job_id, seq=seq, text=text, logprobs=logprobs)])[0]
    if isinstance(result, DomainError):
        raise result
    return result


def job_push_many(pushes: list[Push]) -> list[PushResult | DomainError]:
    """Apply ordered batches of text, each as if alone; one result (or refusal) per batch.

    A retried batch (seq already applied) is acknowledged without being applied twice; a
    batch from the future is refused so the host resends what is missing; a fenced
    attempt's late batch is refused.

    The text is appended as its own chunk, never rewritten into the growing answer, so a
    batch costs O(batch). The common case is one compare-and-set on each job (this host's,
    running, at this `seq`) that advances the request's character count and stores the
    chunk. An empty batch advances `seq` but is not progress (the stall clock ignores it).
    Batches that arrived together share one trip to the database: on PostgreSQL one
    statement for all of them, on SQLite one transaction (one commit). Anything else (a
    retry, a gap, a job that ended or is not this host's) is told apart afterwards.
    """
    now = timezone.now()
    pushes = [Push(host=p.host, job_id=p.job_id, seq=p.seq, text=p.text.replace("\x00", ""), logprobs=p.logprobs)
              for p in pushes]
    # (a byte-level model can emit NUL; no text column, nor client, wants it)
    results: list[PushResult | DomainError | None] = [None] * len(pushes)
    for index, push in enumerate(pushes):
        why = None if push.logprobs is None else entries_problem(push.logprobs, push.text)
        if why is not None:  # refused before anything applies: the host sends the batch right, or stops
            results[index] = bad_request(f"Batch {push.seq}: {why}.", code="invalid_logprobs", param="logprobs")
    for round_ in _rounds(pushes):
        batch = [(index, push) for index, push in round_ if results[index] is None]
        applied = _push_applied(batch, now=now) if batch else {}
        for index, push in batch:
            if index not in applied:
                try:
                    results[index] = _push_refused(host=push.host, job_id=push.job_id, seq=push.seq, size=len(push.text))
                except DomainError as refusal:
                    results[index] = refusal
                continue
            public_id, start = applied[index]
            if push.text:
                message = {"type": "job.tokens", "offset": start, "text": push.text}
                if push.logprobs is not None:
                    message["logprobs"] = push.logprobs
                announce_on_commit(request_group(public_id), message)
            results[index] = PushResult(accepted=True, next_seq=push.seq + 1)
    assert all(result is not None for result in results)
    return [result for result in results if result is not None]


def _rounds(pushes: list[Push]) -> list[list[tuple[int, Push]]]:
    """The pushes in arrival order, cut so that a job appears at most once per round (a
    retry behind its original goes in the next round, and is then told apart)."""
    rounds: list[list[tuple[int, Push]]] = []
    seen: list[set[int]] = []
    for index, push in enumerate(pushes):
        depth = next((at for at in range(len(rounds) - 1, -1, -1) if push.job_id in seen[at]), -1) + 1
        if depth == len(rounds):
            rounds.append([])
            seen.append(set())
        rounds[depth].append((index, push))
        seen[depth].add(push.job_id)
    return rounds


def _push_applied(batch: list[tuple[int, Push]], *, now: datetime) -> dict[int, tuple[str, int]]:
    """The compare-and-set of a round of pushes (each job at most once): for each push that
    applied, by its index, (the request's public id, the chunk's offset). A push that is
    missing was not its host's running job at its `seq`."""
    job_table, request_table, chunk_table = (connection.ops.quote_name(m._meta.db_table) for m in (Job, Request, TextChunk))
    at = connection.ops.adapt_datetimefield_value(now)
    store = f"INSERT INTO {chunk_table} (request_id, job_id, seq, char_offset, text, logprobs)"
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One statement for the whole round: the pushes as a VALUES list, joined to their
            # jobs (the compare-and-set), then to their requests (one live job per request, so
            # no request is advanced twice), then stored as chunks.
            rows = ", ".join(["(%s::bigint, %s::bigint, %s::integer, %s::integer, %s::text, %s::jsonb, %s::integer)"] * len(batch))
            params: list = [value for index, push in batch for value in (
                push.job_id, push.host.pk, push.seq, len(push.text), push.text, _json_or_null(push.logprobs), index)]
            cursor.execute(
                f"WITH batch (job_id, host_id, seq, size, text, logprobs, ord) AS (VALUES {rows}),"
                f" pushed AS (UPDATE {job_table} SET next_seq = next_seq + 1, generated_chars = generated_chars + batch.size,"
                " last_token_at = CASE WHEN batch.size > 0 THEN %s ELSE last_token_at END,"
                " first_token_at = CASE WHEN batch.size > 0 THEN COALESCE(first_token_at, %s) ELSE first_token_at END FROM batch"
                f" WHERE {job_table}.id = batch.job_id AND {job_table}.host_id = batch.host_id AND status = %s"
                " AND next_seq = batch.seq AND (max_chars IS NULL OR generated_chars + batch.size <= max_chars)"
                f" RETURNING {job_table}.request_id, batch.*),"
                f" advanced AS (UPDATE {request_table} SET delivered_chars = delivered_chars + pushed.size FROM pushed"
                f" WHERE {request_table}.id = pushed.request_id RETURNING {request_table}.id, public_id,"
                " delivered_chars - pushed.size AS start, pushed.job_id, pushed.seq, pushed.size, pushed.text, pushed.logprobs,"
                " pushed.ord),"
                f" stored AS ({store} SELECT id, job_id, seq, start, text, logprobs FROM advanced WHERE size > 0)"
                " SELECT ord, public_id, start FROM advanced",
                [*params, at, at, Job.Status.RUNNING],
            )
            return {ord_: (public_id, start) for ord_, public_id, start in cursor.fetchall()}
        applied: dict[int, tuple[str, int]] = {}
        with transaction.atomic():  # one commit for the round (core.sqlite queues this process's writers)
            for index, push in batch:
                size = len(push.text)
                cursor.execute(
                    f"UPDATE {job_table} SET next_seq = next_seq + 1, generated_chars = generated_chars + %s,"
                    " last_token_at = CASE WHEN %s > 0 THEN %s ELSE last_token_at END,"
                    " first_token_at = CASE WHEN %s > 0 THEN COALESCE(first_token_at, %s) ELSE first_token_at END"
                    " WHERE id = %s AND host_id = %s AND status = %s AND next_seq = %s"
                    " AND (max_chars IS NULL OR generated_chars + %s <= max_chars) RETURNING request_id",
                    [size, size, at, size, at, push.job_id, push.host.pk, Job.Status.RUNNING, push.seq, size],
                )
                pushed = cursor.fetchone()
                if pushed is None:
                    continue
                cursor.execute(
                    f"UPDATE {request_table} SET delivered_chars = delivered_chars + %s WHERE id = %s"
                    " RETURNING public_id, delivered_chars - %s", [size, pushed[0], size],
                )
                public_id, start = cursor.fetchone()
                if size:
                    cursor.execute(f"{store} VALUES (%s, %s, %s, %s, %s, %s)",
                                   [pushed[0], push.job_id, push.seq, start, push.text, _json_or_null(push.logprobs)])
                applied[index] = (public_id, start)
    return applied


def _json_or_null(value: object) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _push_refused(*, host: Host, job_id: int, seq: int, size: int) -> PushResult:
    """Why a push did not apply: a retry (acknowledged), a gap, a job that is not running
    or not this host's (refused), or more text than the job's `max_tokens` allows: the
    attempt is then fenced and ended like a dead one (its request continues elsewhere, or
    settles when its budget was delivered)."""
    job = _check_running(
        Job.objects.filter(pk=job_id).only("pk", "host_id", "status", "next_seq", "generated_chars", "max_chars").first(),
        host=host, job_id=job_id,
    )
    if seq < job.next_seq:
        return PushResult(accepted=False, next_seq=job.next_seq)
    if seq == job.next_seq and job.max_chars is not None and job.generated_chars + size > job.max_chars:
        attempt_end_dead(job_id=job_id, reason="sent more text than max_tokens allows")
        raise TextBoundExceeded(
            f"Job {job_id} may carry at most {job.max_chars} characters (its max_tokens); the attempt is ended."
        )
    raise SequenceGap(f"Expected batch {job.next_seq}, got {seq}.")


# --- ending -------------------------------------------------------------------


def _count_output(request: Request, text: str) -> int:
    return tokenizer_for(request.model.tokenizer).count(text, special=False) if text else 0


def _completion_tokens(request: Request, text: str) -> int:
    """Counted by the gateway from the delivered text (read while the job's row is locked,
    so no batch can still land), never above max_tokens."""
    return min(_count_output(request, text), int(request.params["max_tokens"]))


def _rescuer_share(*, request: Request, job: Job, text: str, completion_tokens: int) -> int | None:
    """A continuation host earns 80% of the output it generated itself; the
    first attempt's host (None here) earns the usual 80% of the whole cost."""
    if job.attempt == 1:
        return None
    own = text[len(text) - job.generated_chars :] if job.generated_chars else ""
    own_tokens = min(_count_output(request, own), completion_tokens)
    return billing.split_cost(price(request.model, prompt_tokens=0, completion_tokens=own_tokens)).host_ucents


def ring_memo(ring: tuple[RingPlan, dict[int, int]]) -> str:
    """A ring settlement's ledger memo: who ran how many of the ring's layers."""
    plan, layers = ring
    return f"ring {plan.pk}: " + ", ".join(f"host {host_id} {count}/{plan.n_layers} layers" for host_id, count in layers.items())


@dataclass(frozen=True)
class Completion:
    request: Request
    earned_ucents: int


@transaction.atomic
def job_complete(*, host: Host, job_id: int, finish_reason: str, embeddings: list | None = None) -> Completion:
    """Settle the request: bill the counted tokens, pay the host 80%, delete the prompt.

    An embeddings job completes with its vectors (one per input, checked here) and is
    billed for its input tokens. Repeating the call for a job this host already
    completed (its answer was lost) returns the same result and changes nothing. The
    ledger posting comes last so the customer's hot balance row is locked only until
    the commit.
    """
    job = (  # the job and its request locked in one statement, with what settling reads
        Job.objects.select_for_update(of=("self", "request"))
        .select_related("request", "request__model", "request__hold")
        .filter(pk=job_id)
        .first()
    )
    if job is not None and job.host_id == host.pk and job.status == Job.Status.COMPLETED:
        return Completion(request=job.request, earned_ucents=job.earned_ucents)
    _check_running(job, host=host, job_id=job_id)
    request = job.request
    model = request.model
    if request.kind == Request.Kind.EMBEDDINGS:  # all or nothing: whoever completes did all the work
        result, completion_tokens, share = embeddings_checked(request=request, vectors=embeddings), 0, None
    else:
        if embeddings is not None:
            raise BadResult(f"Job {job_id} is a {request.kind} job; it completes with text, not embeddings.")
        delivered = request.delivered_text
        text, stopped = answer_of(request, delivered)
        counted = _count_output(request, text)
        max_tokens = int(request.params["max_tokens"])
        if tokenizer_for(model.tokenizer).exact and counted > max_tokens + _count_slack(max_tokens):
            raise BadResult(
                f"Job {job_id} delivered {counted} tokens; max_tokens is {max_tokens}. Nothing is settled for this attempt."
            )
        result, completion_tokens = None, min(counted, max_tokens)
        finish_reason = "stop" if stopped else finish_reason_checked(
            claimed=finish_reason, completion_tokens=completion_tokens, max_tokens=max_tokens)
        problem = answer_problem(request.params.get("response_format"), text) if finish_reason == "stop" else None
        if problem is not None:
            return _answer_refused(job=job, request=request, why=f"structured output: {problem}", code="invalid_structured_output",
                                   message=f"The host's answer did not meet response_format ({problem}); nothing was billed.")
        if request.params.get("logprobs") is not None and TextChunk.objects.filter(job=job, logprobs__isnull=True).exists():
            return _answer_refused(job=job, request=request, why="sent text without the log-probabilities asked for",
                                   code="logprobs_missing", message="The host did not report the log-probabilities asked "
                                   "for (a ring or an expert mesh cannot, nor mahout before 0.2.0); nothing was billed.")
        share = _rescuer_share(request=request, job=job, text=delivered, completion_tokens=completion_tokens)
    cost = min(price(model, prompt_tokens=request.prompt_tokens, completion_tokens=completion_tokens), request.hold.amount_ucents)
    hosts_share = share if share is not None else billing.split_cost(cost).host_ucents
    ring = ring_layers(bridge_host_id=host.pk, model_id=model.pk)
    paid = billing.split_by_layers(hosts_share, ring[1]) if ring is not None else {host.pk: hosts_share}
    earned = paid.pop(host.pk)
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.COMPLETED, finished_at=now, completion_tokens=completion_tokens, earned_ucents=earned
    )
    if request.kind != Request.Kind.EMBEDDINGS:  # only the host's own part of the answer says how fast it is
        own = completion_tokens if job.attempt == 1 else _count_output(request, delivered[len(delivered) - job.generated_chars:])
        reputation.speed_measured(job=job, completion_tokens=own, now=now)
    _request_settled(
        request=request, completion_tokens=completion_tokens, cost_ucents=cost, finish_reason=finish_reason, result=result
    )
    split = billing.hold_settle(
        hold=request.hold, cost_ucents=cost, host=host, host_ucents=earned, others=paid, reference=request.public_id,
        memo="" if ring is None else ring_memo(ring),
    )
    if split is None:  # the hold closed under us (expired): roll all of this back, the job ends anyway
        raise JobNotRunning(f"Request {request.public_id} already ended.")
    if ring is not None:
        StageShare.objects.bulk_create(
            StageShare(job_id=job.pk, host_id=host_id, plan=ring[0], layers=ring[1][host_id], n_layers=ring[0].n_layers,
                       earned_ucents=amount, finished_at=now)
            for host_id, amount in paid.items()
        )
    if request.kind != Request.Kind.EMBEDDINGS:
        from marketplace.canaries import canary_judge  # (canaries queue through this module)

        canary_judge(request=request, host=host, text=text, completion_tokens=completion_tokens)
    reputation.trust_review(host_id=host.pk, now=now)
    if job.requeue or job.attempt > 1:  # earlier attempts of this request exist: was one blamed on it wrongly?
        _blame_corrected(request=request, host=host)
    request.status, request.completion_tokens, request.cost_ucents = Request.Status.COMPLETED, completion_tokens, cost
    request.finish_reason, request.messages, request.prompt, request.inputs = finish_reason, None, None, None
    request.result = result
    return Completion(request=request, earned_ucents=split.host_ucents)


def _answer_refused(*, job: Job, request: Request, why: str, code: str, message: str) -> Completion:
    """A finished answer that is not what the request asked for (it breaks its
    `response_format`, it lacks the log-probabilities asked for) is never passed on as a
    success: the attempt is the host's failure (it counts toward its rest) and the request
    fails unbilled. No continuation: it would have to resume from that very text."""
    Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).update(
        status=Job.Status.FAILED, finished_at=timezone.now(), fail_reason=why[:500])
    host_rest_if_unreliable(host_id=job.host_id)
    _request_fail(request=request, code=code, message=message)
    return Completion(request=request, earned_ucents=0)


def stop_at(text: str, stops: list[str] | None) -> int | None:
    """Where the first of the customer's stop sequences starts in `text`, or None: the
    gateway enforces them (the answer ends there) whatever the host did."""
    found = [at for at in (text.find(stop) for stop in stops or [] if stop) if at >= 0]
    return min(found) if found else None


def answer_of(request: Request, text: str) -> tuple[str, bool]:
    """The answer as the customer gets it: the delivered text up to the first stop
    sequence, and whether one was found."""
    cut = stop_at(text, request.params.get("stop"))
    return (text, False) if cut is None else (text[:cut], True)


def relay_token_limit(request: Request) -> int:
    """The most tokens relayed to a customer: `max_tokens` and the slack completion allows
    for counting the text apart from the host (`_count_slack`)."""
    max_tokens = int(request.params["max_tokens"])
    return max_tokens + _count_slack(max_tokens)


def _count_slack(max_tokens: int) -> int:
    """How far the gateway's count of a text may exceed the tokens that generated it: an
    honest host's tokens, counted again, can merge or split at a few places."""
    return 2 + max_tokens // 8


def finish_reason_checked(*, claimed: str, completion_tokens: int, max_tokens: int) -> str:
    """`finish_reason` as the delivered text supports it: "length" when the budget was used
    (whatever the host says), "stop" when the host claims "length" well short of it."""
    if completion_tokens >= max_tokens:
        return "length"
    if claimed == "length" and completion_tokens < max_tokens - _count_slack(max_tokens):
        return "stop"
    return claimed


MAX_EMBEDDING_DIMENSIONS = 8192


def _finite(x: object) -> bool:
    """A number a float can hold (JSON's 10**400 is an int no float can)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def embeddings_checked(*, request: Request, vectors: object) -> list[list[float]]:
    """One finite vector per input, all of one width, or BadResult."""
    count = len(request.inputs or [])
    if not isinstance(vectors, list) or len(vectors) != count:
        raise BadResult(f"Expected 'embeddings' as a list of {count} vectors, one per input.")
    width = request.model.embedding_dimensions
    for index, vector in enumerate(vectors):
        if not isinstance(vector, list) or not 0 < len(vector) <= MAX_EMBEDDING_DIMENSIONS:
            raise BadResult(f"Vector {index} is not a list of 1 to {MAX_EMBEDDING_DIMENSIONS} numbers.")
        if width is not None and len(vector) != width:
            whose = "the model's" if request.model.embedding_dimensions else "the first vector's"
            raise BadResult(f"Vector {index} has {len(vector)} dimensions; {whose} width is {width}.")
        width = len(vector)
        if not all(_finite(x) for x in vector):
            raise BadResult(f"Vector {index} holds something that is not a finite number.")
    return [[float(x) for x in vector] for vector in vectors]


def _request_settled(
    *, request: Request, completion_tokens: int, cost_ucents: int, finish_reason: str, result: list | None = None
) -> None:
    Request.objects.filter(pk=request.pk).update(
        status=Request.Status.COMPLETED,
        finished_at=timezone.now(),
        completion_tokens=completion_tokens,
        cost_ucents=cost_ucents,
        finish_reason=finish_reason,
        messages=None,
        prompt=None,
        inputs=None,
        result=result,
    )
    announce_on_commit(request_group(request.public_id), {"type": "request.ended"})


def _request_fail(*, request: Request, code: str, message: str) -> bool:
    """End a request unbilled: release its hold and delete its prompt."""
    ended = Request.objects.filter(
        pk=request.pk, status__in=[Request.Status.QUEUED, Request.Status.RUNNING]
    ).update(
        status=Request.Status.FAILED,
        finished_at=timezone.now(),
        error_code=code,
        error_message=message[:500],
        messages=None,
        prompt=None,
        inputs=None,
    )
    if not ended:
        return False
    billing.hold_release(hold=Hold.objects.get(pk=request.hold_id))
    announce_on_commit(request_group(request.public_id), {"type": "request.ended"})
    return True


MAX_ATTEMPTS = 2  # the first host, and once per request another one that continues
MAX_REQUEUES = 3  # deaths before the first token that put an attempt back in the queue


@transaction.atomic
def job_fail(*, host: Host, job_id: int, reason: str, cause: str = "host") -> str:
    """The host gave up on a job: continue it elsewhere once, else fail honestly (`cause`:
    see `attempt_end_dead`)."""
    _locked_job_of(host=host, job_id=job_id)
    return attempt_end_dead(job_id=job_id, reason=reason, cause=cause)


def _blame_corrected(*, request: Request, host: Host) -> int:
    """`host` served a request an earlier host said could not be run: that host's failure
    was its own after all (it counts toward its maintenance). Returns how many were."""
    blamed = list(Job.objects.filter(request_id=request.pk, fail_cause="request").exclude(host_id=host.pk)
                  .values_list("pk", "host_id"))
    if blamed:
        Job.objects.filter(pk__in=[pk for pk, _ in blamed]).update(fail_cause="host")
        for host_id in {host_id for _, host_id in blamed}:
            host_rest_if_unreliable(host_id=host_id)
    return len(blamed)


@transaction.atomic
def attempt_end_dead(*, job_id: int, reason: str, cause: str = "host") -> str:
    """Fence a dead attempt and decide what happens to its request.

    The attempt is marked failed first (compare-and-set), so anything it still
    sends is refused. An attempt that died before its first token is simply put
    back in the queue (seed 001): the same attempt again, silently — no `resumed`,
    the request's one continuation still unspent, the dead host skipped for the
    grace — at most MAX_REQUEUES times, and the queue timeout still ends it
    honestly. After the first token, once per request, a continuation job is queued
    that resumes from exactly the delivered text, preferring another host; a second
    death fails the request unbilled. Returns "requeued", "continued", "settled"
    (the output budget was already used up), "failed", or "" when the attempt had
    already ended (someone else got there first).

    `cause` "request": the host says the job's own content cannot be run. That is no
    strike against it; the request gets a second opinion from another host (the same
    rules as a death), and fails honestly ("request_not_runnable", unbilled) when a
    second host says so too. A host that blames a request another host then serves is
    counted as having failed (`_blame_corrected`, at completion).
    """
    if not Job.objects.filter(pk=job_id, status=Job.Status.RUNNING).update(
        status=Job.Status.FAILED, finished_at=timezone.now(), fail_reason=reason[:500], fail_cause=cause
    ):
        return ""
    job = Job.objects.get(pk=job_id)
    if cause != "request":
        host_rest_if_unreliable(host_id=job.host_id)
    request = Request.objects.select_for_update().select_related("model", "hold").get(pk=job.request_id)
    if request.status != Request.Status.RUNNING:
        return ""
    if cause == "request" and Job.objects.filter(request_id=request.pk, fail_cause="request").exclude(host_id=job.host_id).exists():
        _request_fail(request=request, code="request_not_runnable",
                      message=f"Two hosts could not run this request ({reason[:300]}); nothing was billed.")
        return "failed"
    from marketplace.canaries import canary_void, is_canary  # (canaries queue through this module)

    if is_canary(request):  # a canary tests one host: it is never handed to another
        _request_fail(request=request, code="host_failed", message="The host did not answer this canary.")
        canary_void(request=request)
        return "failed"
    if job.generated_chars == 0 and job.requeue < MAX_REQUEUES:  # nothing of this attempt reached the customer
        job_queue(request=request, model=request.model, attempt=job.attempt, requeue=job.requeue + 1, avoid_host_id=job.host_id,
                  trusted_only=job.trusted_only)
        return "requeued"
    if job.attempt >= MAX_ATTEMPTS:
        _request_fail(
            request=request, code="host_failed",
            message="The host serving this request failed, and so did the host that took over; nothing was billed.",
        )
        return "failed"
    answer, stopped = ("", False) if request.kind == Request.Kind.EMBEDDINGS else answer_of(request, request.delivered_text)
    delivered_tokens = _completion_tokens(request, answer) if answer else 0
    if request.kind != Request.Kind.EMBEDDINGS and (stopped or delivered_tokens >= int(request.params["max_tokens"])):
        _settle_without_host(request=request, completion_tokens=delivered_tokens, finish_reason="stop" if stopped else "length")
        return "settled"
    Request.objects.filter(pk=request.pk).update(resumed=True)
    job_queue(request=request, model=request.model, attempt=job.attempt + 1, avoid_host_id=job.host_id, trusted_only=job.trusted_only)
    announce_on_commit(request_group(request.public_id), {"type": "job.resumed"})
    return "continued"


def host_rest_if_unreliable(*, host_id: int | None) -> bool:
    """Put a host in maintenance once it has dropped or failed more than
    HOST_MAX_FAILURES_PER_HOUR jobs in the last hour; its owner sees why."""
    if host_id is None:
        return False
    since = timezone.now() - timedelta(hours=1)
    failures = (
        Job.objects.filter(host_id=host_id, status=Job.Status.FAILED, finished_at__gte=since).exclude(fail_cause="request").count()
    )
    if failures <= settings.HOST_MAX_FAILURES_PER_HOUR:
        return False
    reason = (
        f"{failures} jobs dropped or failed in the last hour (the limit is {settings.HOST_MAX_FAILURES_PER_HOUR}). "
        "Check the machine, then resume it."
    )
    return host_maintenance_enter(host=Host.objects.get(pk=host_id), reason=reason, by="automatic")


def _settle_without_host(*, request: Request, completion_tokens: int, finish_reason: str = "length") -> None:
    """Every allowed token (or a stop sequence) was delivered before the host died: the
    answer is whole, the customer pays for it, and no host is paid (none finished)."""
    model = request.model
    cost = min(price(model, prompt_tokens=request.prompt_tokens, completion_tokens=completion_tokens), request.hold.amount_ucents)
    billing.hold_settle(hold=request.hold, cost_ucents=cost, host=None, reference=request.public_id)
    _request_settled(request=request, completion_tokens=completion_tokens, cost_ucents=cost, finish_reason=finish_reason)


def job_reoffer(*, job_id: int) -> int | None:
    """Offer a queued job whose offer lapsed (or that had none) to a warm host with a free
    slot, chosen by the model's strategy, so the strategy orders every warm claim and not
    only the first offer (seed 002). The host that let the offer lapse and a continuation's
    dead host are passed over; a canary stays its host's. A compare-and-set on the lapsed
    offer: a claim or another re-offer that got there first wins. Returns the host offered."""
    now = timezone.now()
    job = Job.objects.select_related("model").filter(pk=job_id, status=Job.Status.QUEUED).first()
    if job is None or job.only_host_id is not None or (job.offer_until is not None and job.offer_until >= now):
        return None
    passed_over = frozenset({job.offered_host_id, job.avoid_host_id})
    pool = routing.candidates(model=job.model, now=now, trusted_only=job.trusted_only, passed_over=passed_over)
    chosen = routing.pick(model=job.model, pool=pool, now=now)
    if chosen is None:
        return None
    if not Job.objects.filter(
        pk=job.pk, status=Job.Status.QUEUED, offered_host_id=job.offered_host_id, offer_until=job.offer_until
    ).update(offered_host_id=chosen.host_id, offer_until=now + timedelta(seconds=settings.ROUTING_OFFER_SECONDS)):
        return None
    job.offered_host_id = chosen.host_id
    _job_announce(job)
    return chosen.host_id


@transaction.atomic
def request_expire_unclaimed(*, request_id: int) -> bool:
    """No host claimed the request (or its continuation) in time: fail it, release the hold."""
    job = Job.objects.filter(request_id=request_id, status=Job.Status.QUEUED).first()
    if job is None:
        return False
    if not Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED).update(
        status=Job.Status.FAILED, finished_at=timezone.now(), fail_reason="not claimed in time"
    ):
        return False
    if job.attempt == 1 and request_reroute(request_id=request_id, requeue=job.requeue + 1, trusted_only=job.trusted_only):
        return True
    wait = f"{settings.QUEUE_TIMEOUT_SECONDS:g} seconds"
    before = Job.objects.filter(request_id=request_id, attempt=job.attempt, requeue=job.requeue - 1).values_list(
        "fail_reason", flat=True).first()
    if job.attempt > 1 or (job.requeue > 0 and before != "not claimed in time"):  # (a fallback's queue is a queue)
        code, message = "host_failed", f"The host serving this request failed and no other host took over within {wait}; nothing was billed."
    else:
        code, message = "queue_timeout", f"No host claimed this request within {wait}; nothing was billed."
    return _request_fail(request=Request.objects.get(pk=request_id), code=code, message=message)


def request_reroute(*, request_id: int, requeue: int, trusted_only: bool = False) -> bool:
    """A request whose model's queue timed out goes to its next fallback model (`models`,
    `params["fallbacks"]`), as the first attempt again (its `requeue` counts on): nothing
    was delivered yet. Its hold
    stays when it covers the new model's worst case, and is placed again otherwise (a
    refusal then ends the request with it). Fallbacks that no longer exist, or whose
    context the request does not fit, are skipped. False when none is left."""
    request = Request.objects.select_for_update().select_related("model", "hold", "api_key", "user").filter(
        pk=request_id, status=Request.Status.QUEUED).first()
    fallbacks = list((request.params or {}).get("fallbacks") or []) if request is not None else []
    while fallbacks:
        model = CatalogModel.objects.filter(name=fallbacks.pop(0), active=True, kind=CatalogModel.Kind.CHAT).first()
        if model is None:
            continue
        rendered = render_job({"kind": request.kind, "messages": request.messages, "prompt": request.prompt})
        prompt_tokens = tokenizer_for(model.tokenizer).count(rendered, special=True)
        max_tokens = int(request.params["max_tokens"])
        if prompt_tokens + max_tokens > model.context_length:
            continue
        estimate = estimate_ucents(model=model, prompt_tokens=prompt_tokens, max_tokens=max_tokens)
        if estimate > request.hold.amount_ucents:
            billing.hold_release(hold=request.hold)
            try:
                request.hold = billing.hold_place(user=request.user, api_key=request.api_key, amount_ucents=estimate)
            except DomainError as refused:
                _request_fail(request=request, code=refused.code, message=f"Falling back to {model.name}: {refused.message}")
                return True
        request.model, request.prompt_tokens, request.estimate_ucents = model, prompt_tokens, estimate
        request.params = {**request.params, "fallbacks": fallbacks}
        request.save(update_fields=["model", "prompt_tokens", "estimate_ucents", "params", "hold"])
        job_queue(request=request, model=model, trusted_only=trusted_only, requeue=requeue)
        announce_on_commit(request_group(request.public_id), {"type": "request.rerouted", "model": model.name})
        return True
    return False


def job_stalled_end(*, job_id: int) -> str:
    """A running attempt produced nothing for STALL_SECONDS: its host is presumed dead."""
    return attempt_end_dead(job_id=job_id, reason=f"no token for {settings.STALL_SECONDS:g} seconds")


def job_progress(*, host: Host, job_id: int) -> None:
    """The host is still loading or prefilling this job (no token yet): a sign of life that
    keeps the attempt alive past its start bound (`job_start_overdue`). A job that is not
    this host's, or not running, is refused as a batch would be (the host must stop)."""
    if Job.objects.filter(pk=job_id, host_id=host.pk, status=Job.Status.RUNNING).update(progress_at=timezone.now()):
        return
    _check_running(Job.objects.filter(pk=job_id).first(), host=host, job_id=job_id)


def job_start_bound_seconds(*, job: Job) -> float:
    """How long the host may take to its first token before silence counts: its own
    benchmark's load time and the prompt at its prompt tokens/s, plus
    JOB_START_SLACK_SECONDS, at most JOB_START_ALLOWANCE_SECONDS. (The benchmark is the
    host's word: the allowance bounds what a lie can buy.)"""
    seconds = settings.JOB_START_SLACK_SECONDS
    figures = (
        Qualification.objects.filter(host_id=job.host_id, model_id=job.model_id).order_by("-updated_at")
        .values_list("load_ms", "prompt_tps").first()
    )
    if figures is not None:
        load_ms, prompt_tps = figures
        prompt_tokens = Request.objects.filter(pk=job.request_id).values_list("prompt_tokens", flat=True).first() or 0
        seconds += load_ms / 1000 + (prompt_tokens / prompt_tps if prompt_tps > 0 else 0)
    return min(seconds, settings.JOB_START_ALLOWANCE_SECONDS)


def job_start_overdue(*, job: Job, now: datetime) -> bool:
    """Whether a running attempt that has sent no token yet is dead (seed 001: before the
    first token a loading or prefilling host has a bounded deadline, not the stall clock):
    past its start bound and silent (no progress report) for STALL_SECONDS, or past
    JOB_START_ALLOWANCE_SECONDS from its claim whatever it reports."""
    if job.claimed_at is None or job.first_token_at is not None:
        return False
    since_claim = (now - job.claimed_at).total_seconds()
    if since_claim > settings.JOB_START_ALLOWANCE_SECONDS:
        return True
    silent = (now - (job.progress_at or job.claimed_at)).total_seconds()
    if silent <= settings.STALL_SECONDS or since_claim <= settings.JOB_START_SLACK_SECONDS:
        return False
    return since_claim > job_start_bound_seconds(job=job)


def job_unstarted_end(*, job_id: int) -> str:
    """A running attempt overran its start bound with no token (`job_start_overdue`): it
    goes back to the queue (it delivered nothing)."""
    return attempt_end_dead(job_id=job_id, reason="no first token within its start bound")


def job_overdue_end(*, job_id: int) -> str:
    """A running attempt outlived its deadline (`job_limits`): however it trickles, it ends."""
    return attempt_end_dead(job_id=job_id, reason="still running at its deadline")


def host_connection_lost(*, host_id: int, opened_at: datetime | None = None) -> int:
    """The host's presence connection dropped (a killed process closes its sockets): every
    attempt it was running is dead. Returns how many. With `opened_at` (when the dropped
    socket opened), a host that has opened a newer socket since is back, and nothing dies:
    the drop was the network's or a gateway process's fault, not the host's."""
    if opened_at is not None and Host.objects.filter(pk=host_id, socket_since__gt=opened_at).exists():
        return 0
    running = list(Job.objects.filter(host_id=host_id, status=Job.Status.RUNNING).values_list("pk", flat=True))
    return sum(1 for job_id in running if attempt_end_dead(job_id=job_id, reason="the host's connection dropped"))


@transaction.atomic
def host_ban_with_consequences(*, host: Host, reason: str, by: str) -> bool:
    """An operator's ban (`hosts.services.host_ban`: refused everywhere, token revoked), and
    what follows from it here: its running jobs are ended now and continued elsewhere, and
    its earnings that have not vested are forfeited to the platform with the reason."""
    if not host_ban(host=host, reason=reason, by=by):
        return False
    running = list(Job.objects.filter(host_id=host.pk, status=Job.Status.RUNNING).values_list("pk", flat=True))
    for job_id in running:
        attempt_end_dead(job_id=job_id, reason="its host was banned")
    billing.earnings_forfeit(host=host, reason=f"Banned by {by}: {reason}")
    return True


def request_watch(*, request_id: int) -> None:
    """Apply the watchdog rules to one request (its stream calls this while quiet)."""
    job = Job.objects.filter(request_id=request_id, status__in=[Job.Status.QUEUED, Job.Status.RUNNING]).first()
    if job is None:
        return
    now = timezone.now()
    if job.status == Job.Status.QUEUED and job.created_at < now - timedelta(seconds=settings.QUEUE_TIMEOUT_SECONDS):
        request_expire_unclaimed(request_id=request_id)
    elif job.status == Job.Status.QUEUED and (job.offer_until is None or job.offer_until < now):
        job_reoffer(job_id=job.pk)
    elif job.status == Job.Status.RUNNING and job.first_token_at is None:
        if job_start_overdue(job=job, now=now):
            job_unstarted_end(job_id=job.pk)
    elif job.status == Job.Status.RUNNING and job.last_token_at < now - timedelta(seconds=settings.STALL_SECONDS):
        job_stalled_end(job_id=job.pk)
    elif job.status == Job.Status.RUNNING and job.deadline_at is not None and job.deadline_at < now:
        job_overdue_end(job_id=job.pk)


def request_listener_left(*, request_id: int) -> bool:
    """The customer's connection to a request that is still running went away (the stream
    dropped, or a client waiting for the whole answer hung up). Unless one re-attaches
    within ABANDON_GRACE_SECONDS (a dropped stream resumes), the request is abandoned."""
    return bool(Request.objects.filter(pk=request_id, status__in=[Request.Status.QUEUED, Request.Status.RUNNING])
                .update(left_at=timezone.now()))


def request_listener_here(*, request_id: int) -> bool:
    """A customer is listening again (a re-attach, or another open stream of the request)."""
    return bool(Request.objects.filter(pk=request_id, left_at__isnull=False).update(left_at=None))


def request_withdraw(*, request_id: int) -> str:
    """End a request now as if abandoned long ago (a sibling choice of `n` was refused at
    admission): queued, it ends unbilled. Returns what request_abandon returns."""
    Request.objects.filter(pk=request_id, status__in=[Request.Status.QUEUED, Request.Status.RUNNING]).update(
        left_at=timezone.now() - timedelta(seconds=settings.ABANDON_GRACE_SECONDS + 1))
    return request_abandon(request_id=request_id)


@transaction.atomic
def request_abandon(*, request_id: int) -> str:
    """Nobody has listened to this request for ABANDON_GRACE_SECONDS: stop paying for it.

    A queued job is withdrawn and the request ends unbilled. A running job ends now: its
    host's next batch is refused (it stops), the tokens delivered so far are billed and its
    host is paid for them as for any answer, and the request ends with finish_reason
    "cancelled". Nothing is a strike against the host. Returns "cancelled", "settled", or ""
    (it ended meanwhile, or someone re-attached)."""
    cutoff = timezone.now() - timedelta(seconds=settings.ABANDON_GRACE_SECONDS)
    request = (
        Request.objects.select_for_update().select_related("model", "hold")
        .filter(pk=request_id, status__in=[Request.Status.QUEUED, Request.Status.RUNNING], left_at__lt=cutoff).first()
    )
    if request is None:
        return ""
    job = Job.objects.filter(request=request, status__in=[Job.Status.QUEUED, Job.Status.RUNNING]).first()
    running = job is not None and job.status == Job.Status.RUNNING and request.kind != Request.Kind.EMBEDDINGS
    answer = answer_of(request, request.delivered_text)[0] if running else ""  # (a queued job delivered nothing)
    tokens = min(_completion_tokens(request, answer), int(request.params.get("max_tokens") or 0)) if answer else 0
    if job is None or job.status == Job.Status.QUEUED or tokens == 0:
        if job is not None:
            Job.objects.filter(pk=job.pk, status__in=[Job.Status.QUEUED, Job.Status.RUNNING]).update(
                status=Job.Status.FAILED, finished_at=timezone.now(), fail_reason="the customer went away", fail_cause="request")
        _request_fail(request=request, code="cancelled", message="The customer went away before any text; nothing was billed.")
        return "cancelled"
    host = Host.objects.get(pk=job.host_id)
    cost = min(price(request.model, prompt_tokens=request.prompt_tokens, completion_tokens=tokens), request.hold.amount_ucents)
    share = _rescuer_share(request=request, job=job, text=answer, completion_tokens=tokens)
    earned = share if share is not None else billing.split_cost(cost).host_ucents
    if not Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).update(
        status=Job.Status.COMPLETED, finished_at=timezone.now(), completion_tokens=tokens, earned_ucents=earned,
        fail_reason="the customer went away: the answer so far was settled",
    ):
        return ""
    _request_settled(request=request, completion_tokens=tokens, cost_ucents=cost, finish_reason="cancelled")
    billing.hold_settle(hold=request.hold, cost_ucents=cost, host=host, host_ucents=earned, reference=request.public_id)
    return "settled"


def request_forget_output(*, request_id: int) -> bool:
    """Delete the delivered text (or vectors) of an ended request once it has been handed
    over, and with it the customer's stop strings (the last text of theirs a request
    keeps: they cut that text when it is re-read, so they live exactly as long)."""
    with transaction.atomic():
        row = (
            Request.objects.select_for_update()
            .filter(pk=request_id, status__in=[Request.Status.COMPLETED, Request.Status.FAILED], output_forgotten=False)
            .values("params").first()
        )
        if row is None:
            return False
        params = {name: value for name, value in (row["params"] or {}).items() if name not in CUSTOMER_TEXT_PARAMS}
        Request.objects.filter(pk=request_id).update(result=None, output_forgotten=True, params=params)
        TextChunk.objects.filter(request_id=request_id).delete()
    return True


CUSTOMER_TEXT_PARAMS = ("stop", "response_format", "tools")  # the request parameters that are the customer's own text


# --- watchdog steps (Celery beat calls the tick; tests call the steps) ----------------


def unclaimed_request_expire_one() -> bool:
    cutoff = timezone.now() - timedelta(seconds=settings.QUEUE_TIMEOUT_SECONDS)
    job = Job.objects.filter(status=Job.Status.QUEUED, created_at__lt=cutoff).order_by("created_at").first()
    return job is not None and request_expire_unclaimed(request_id=job.request_id)


def stalled_job_end_one() -> bool:
    """A stream that stopped: no token for STALL_SECONDS after its first."""
    cutoff = timezone.now() - timedelta(seconds=settings.STALL_SECONDS)
    job = (
        Job.objects.filter(status=Job.Status.RUNNING, first_token_at__isnull=False, last_token_at__lt=cutoff)
        .order_by("last_token_at").first()
    )
    return job is not None and bool(job_stalled_end(job_id=job.pk))


def unstarted_job_end_one() -> bool:
    """An attempt that overran its start bound with no token (`job_start_overdue`), oldest
    claims first."""
    now = timezone.now()
    earliest = min(max(settings.STALL_SECONDS, settings.JOB_START_SLACK_SECONDS), settings.JOB_START_ALLOWANCE_SECONDS)
    waiting = Job.objects.filter(
        status=Job.Status.RUNNING, first_token_at__isnull=True, claimed_at__lt=now - timedelta(seconds=earliest)
    ).order_by("claimed_at")
    for job in waiting[:20]:
        if job_start_overdue(job=job, now=now):
            return bool(job_unstarted_end(job_id=job.pk))
    return False


def abandoned_request_end_one() -> bool:
    """A request whose customer went away and did not come back within the grace."""
    cutoff = timezone.now() - timedelta(seconds=settings.ABANDON_GRACE_SECONDS)
    request_id = (
        Request.objects.filter(status__in=[Request.Status.QUEUED, Request.Status.RUNNING], left_at__lt=cutoff)
        .order_by("left_at").values_list("pk", flat=True).first()
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


def overdue_job_end_one() -> bool:
    job = Job.objects.filter(status=Job.Status.RUNNING, deadline_at__lt=timezone.now()).order_by("deadline_at").first()
    return job is not None and bool(job_overdue_end(job_id=job.pk))


WATCHDOG_STEPS = (
    unclaimed_request_expire_one, stalled_job_end_one, unstarted_job_end_one, overdue_job_end_one, abandoned_request_end_one,
    ended_output_forget_one,
)


def watchdog_tick(*, max_steps: int = 200) -> int:
    """Run every step until none has work left (bounded). Returns steps taken."""
    taken = 0
    for step in WATCHDOG_STEPS:
        while taken < max_steps and step():
            taken += 1
    return taken
