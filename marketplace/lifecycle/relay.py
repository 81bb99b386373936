"""Text on its way from a host to the customer: each batch is a compare-and-set on the
job (this host's, running, at this `seq`, within its text bound) that appends a chunk and
advances the request, told to its listeners after the commit. Batches that arrive together
share one trip to the database. A host's progress report before its first token lives here
too: it is the other sign of life.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.utils import timezone

from core.errors import DomainError, bad_request
from core.events import announce_on_commit, request_group
from hosts.models import Host
from marketplace.lifecycle.claims import check_running
from marketplace.lifecycle.errors import SequenceGap, TextBoundExceeded
from marketplace.lifecycle.failover import attempt_end_dead
from marketplace.logprobs import entries_problem
from marketplace.models import Job, Request, TextChunk

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
    finish_reason: str = (
        ""  # "stop" or "length" on the answer's last batch: the host's generation ended (`Job.text_end`)
    )


def job_push_tokens(
    *,
    host: Host,
    job_id: int,
    seq: int,
    text: str,
    logprobs: list[dict] | None = None,
    finish_reason: str = "",
) -> PushResult:
    """Apply one ordered batch of text (see `job_push_many`); raises its refusal."""
    result = job_push_many(
        [Push(host=host, job_id=job_id, seq=seq, text=text, logprobs=logprobs, finish_reason=finish_reason)]
    )[0]
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
    A batch's `finish_reason` is kept on the job (`text_end`): if its host dies before
    completing, the answer is whole and settles (`failover`).
    Batches that arrived together share one trip to the database: on PostgreSQL one
    statement for all of them, on SQLite one transaction (one commit). Anything else (a
    retry, a gap, a job that ended or is not this host's) is told apart afterwards.
    """
    now = timezone.now()
    pushes = [
        Push(
            host=p.host,
            job_id=p.job_id,
            seq=p.seq,
            text=p.text.replace("\x00", ""),
            logprobs=p.logprobs,
            finish_reason=p.finish_reason,
        )
        for p in pushes
    ]
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
                    results[index] = _push_refused(
                        host=push.host, job_id=push.job_id, seq=push.seq, size=len(push.text)
                    )
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
    job_table, request_table, chunk_table = (
        connection.ops.quote_name(m._meta.db_table) for m in (Job, Request, TextChunk)
    )
    at = connection.ops.adapt_datetimefield_value(now)
    store = f"INSERT INTO {chunk_table} (request_id, job_id, seq, char_offset, text, logprobs)"
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One statement for the whole round: the pushes as a VALUES list, joined to their
            # jobs (the compare-and-set), then to their requests (one live job per request, so
            # no request is advanced twice), then stored as chunks.
            rows = ", ".join(
                ["(%s::bigint, %s::bigint, %s::integer, %s::integer, %s::text, %s::jsonb, %s::text, %s::integer)"]
                * len(batch)
            )
            params: list = [
                value
                for index, push in batch
                for value in (
                    push.job_id,
                    push.host.pk,
                    push.seq,
                    len(push.text),
                    push.text,
                    _json_or_null(push.logprobs),
                    push.finish_reason,
                    index,
                )
            ]
            cursor.execute(
                f"WITH batch (job_id, host_id, seq, size, text, logprobs, finish, ord) AS (VALUES {rows}),"
                f" pushed AS (UPDATE {job_table} SET next_seq = next_seq + 1,"
                " generated_chars = generated_chars + batch.size,"
                " text_end = COALESCE(NULLIF(batch.finish, ''), text_end),"
                " last_token_at = CASE WHEN batch.size > 0 THEN %s ELSE last_token_at END,"
                " first_token_at = CASE WHEN batch.size > 0 THEN COALESCE(first_token_at, %s) ELSE first_token_at END"
                " FROM batch"
                f" WHERE {job_table}.id = batch.job_id AND {job_table}.host_id = batch.host_id AND status = %s"
                " AND next_seq = batch.seq AND (max_chars IS NULL OR generated_chars + batch.size <= max_chars)"
                f" RETURNING {job_table}.request_id, batch.*),"
                f" advanced AS (UPDATE {request_table} SET delivered_chars = delivered_chars + pushed.size FROM pushed"
                f" WHERE {request_table}.id = pushed.request_id RETURNING {request_table}.id, public_id,"
                " delivered_chars - pushed.size AS start, pushed.job_id,"
                " pushed.seq, pushed.size, pushed.text, pushed.logprobs,"
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
                    " text_end = COALESCE(NULLIF(%s, ''), text_end),"
                    " last_token_at = CASE WHEN %s > 0 THEN %s ELSE last_token_at END,"
                    " first_token_at = CASE WHEN %s > 0 THEN COALESCE(first_token_at, %s) ELSE first_token_at END"
                    " WHERE id = %s AND host_id = %s AND status = %s AND next_seq = %s"
                    " AND (max_chars IS NULL OR generated_chars + %s <= max_chars) RETURNING request_id",
                    [
                        size,
                        push.finish_reason,
                        size,
                        at,
                        size,
                        at,
                        push.job_id,
                        push.host.pk,
                        Job.Status.RUNNING,
                        push.seq,
                        size,
                    ],
                )
                pushed = cursor.fetchone()
                if pushed is None:
                    continue
                cursor.execute(
                    f"UPDATE {request_table} SET delivered_chars = delivered_chars + %s WHERE id = %s"
                    " RETURNING public_id, delivered_chars - %s",
                    [size, pushed[0], size],
                )
                public_id, start = cursor.fetchone()
                if size:
                    cursor.execute(
                        f"{store} VALUES (%s, %s, %s, %s, %s, %s)",
                        [pushed[0], push.job_id, push.seq, start, push.text, _json_or_null(push.logprobs)],
                    )
                applied[index] = (public_id, start)
    return applied


def _json_or_null(value: object) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _push_refused(*, host: Host, job_id: int, seq: int, size: int) -> PushResult:
    """Why a push did not apply: a retry (acknowledged), a gap, a job that is not running
    or not this host's (refused), or more text than the job's `max_tokens` allows: the
    attempt is then fenced and ended like a dead one (its request continues elsewhere, or
    settles when its budget was delivered)."""
    job = check_running(
        Job.objects.filter(pk=job_id)
        .only("pk", "host_id", "status", "next_seq", "generated_chars", "max_chars")
        .first(),
        host=host,
        job_id=job_id,
    )
    if seq < job.next_seq:
        return PushResult(accepted=False, next_seq=job.next_seq)
    if seq == job.next_seq and job.max_chars is not None and job.generated_chars + size > job.max_chars:
        attempt_end_dead(job_id=job_id, reason="sent more text than max_tokens allows")
        raise TextBoundExceeded(
            f"Job {job_id} may carry at most {job.max_chars} characters (its max_tokens); the attempt is ended."
        )
    raise SequenceGap(f"Expected batch {job.next_seq}, got {seq}.")


def job_progress(*, host: Host, job_id: int) -> None:
    """The host is still loading or prefilling this job (no token yet): a sign of life that
    keeps the attempt alive past its start bound (`job_start_overdue`). A job that is not
    this host's, or not running, is refused as a batch would be (the host must stop)."""
    if Job.objects.filter(pk=job_id, host_id=host.pk, status=Job.Status.RUNNING).update(progress_at=timezone.now()):
        return
    check_running(Job.objects.filter(pk=job_id).first(), host=host, job_id=job_id)
