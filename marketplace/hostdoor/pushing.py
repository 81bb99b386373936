"""Token batches from many hosts share trips to the database (group commit).

Each push alone would cost a hand-off to a database thread, a statement and a commit. Here
one writer per event loop takes every batch that arrived while its previous trip was under
way and applies them together (`services.job_push_many`: one statement on PostgreSQL, one
transaction on SQLite), with at most MAX_TRIPS trips under way. A lone batch goes at once,
so a quiet gateway adds no delay; a busy one sends bigger trips instead of queueing more of
them. Each caller still gets its own batch's answer or refusal, exactly as if it had been
applied alone, and a batch that fails the trip fails alone (`_applied`): one host cannot
break every host's stream. Both host doors (the WebSocket and
`POST /hosts/api/jobs/<id>/tokens`) go through here, after the same bounds
(`TokenBatchSerializer`).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from django.core.validators import ProhibitNullCharactersValidator
from django.db import InterfaceError, OperationalError, connection
from rest_framework import serializers

from core.db import db
from core.errors import DomainError, bad_request
from core.http import INT_MAX, IdConverter
from hosts.models import Host
from marketplace import services

logger = logging.getLogger(__name__)

MAX_PUSHES_PER_TRIP = 200  # bounds one statement's size (each push is at most MAX_BATCH_CHARS)
# Trips under way at once. On PostgreSQL several, so one waiting on a row lock does not hold
# up every host; SQLite lets one writer in at a time anyway, so one trip, as big as it gets.
MAX_TRIPS = {"postgresql": 4}


class BatchTextField(serializers.CharField):
    """A batch's text: any string within MAX_BATCH_CHARS, NUL included (a byte-level model can
    emit one; `job_push_many` drops it rather than refusing the host's honest batch)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_blank=True, trim_whitespace=False, max_length=services.MAX_BATCH_CHARS, **kwargs)
        self.validators = [v for v in self.validators if not isinstance(v, ProhibitNullCharactersValidator)]


class TokenBatchSerializer(serializers.Serializer):
    """A batch of a job's text as both host doors read it (`POST /hosts/api/jobs/<id>/tokens`'s
    body and the socket's `tokens` frame): every number bounded as the column it lands in
    (`seq`: an integer column), so no batch reaches the shared trip to the database
    (`PushWriter`) with a value it cannot hold."""

    seq = serializers.IntegerField(min_value=0, max_value=INT_MAX)
    text = BatchTextField()
    logprobs = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        allow_null=True,
        max_length=services.MAX_BATCH_CHARS,
        help_text=(
            "the text's tokens' log-probability entries, when the job asked for them (their tokens spell the text)"
        ),
    )
    finish_reason = serializers.ChoiceField(
        choices=["stop", "length"],
        required=False,
        default="",
        help_text="on the answer's last batch: generation ended (EOS, or max_tokens); a death before `complete` then "
        "settles the answer instead of continuing it",
    )


class TokensFrameSerializer(TokenBatchSerializer):
    """The socket's `tokens` frame: the HTTP body's fields, and the job's id that HTTP reads from
    its path (bounded as the path's `<id:job_id>` is: `core.http.IdConverter`)."""

    job = serializers.IntegerField(min_value=0, max_value=IdConverter.limit)


class PushWriter:
    def __init__(self) -> None:
        self._waiting: list[tuple[services.Push, asyncio.Future]] = []
        self._trips = 0

    async def push(self, push: services.Push) -> services.PushResult:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((push, future))
        if self._trips < MAX_TRIPS.get(connection.vendor, 1):
            self._trips += 1
            asyncio.ensure_future(self._drain())
        result = await future
        if isinstance(result, DomainError):
            raise result
        return result

    async def _drain(self) -> None:
        try:
            while self._waiting:
                taken = self._waiting[:MAX_PUSHES_PER_TRIP]
                del self._waiting[:MAX_PUSHES_PER_TRIP]
                results = await _applied([push for push, _ in taken])
                for (_, future), result in zip(taken, results, strict=True):
                    if future.done():  # its caller went away (a closed connection)
                        continue
                    if isinstance(result, Exception) and not isinstance(result, DomainError):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._trips -= 1


async def _applied(pushes: list[services.Push]) -> list[services.PushResult | DomainError | Exception]:
    """One trip for `pushes`; one result, refusal or failure for each.

    A trip that fails as a whole (one host's batch the database cannot take fails the
    statement, or the transaction, that carries everyone's) is split in halves, each tried
    again in order, until the batch that fails is alone: it alone is refused (400,
    `batch_unstorable`); the others are applied as if it had not been there. No batch is
    applied twice: one that a failed trip applied already (in a round before the one that
    failed) is acknowledged as a retry. The honest case keeps its one trip; a bad batch costs
    its trip about 2·log2(size) more. A database that fails whatever it is sent (a lost
    connection, a lock held too long) fails the whole trip, as before: no batch is at fault."""
    try:
        return list(await db(services.job_push_many, pushes))
    except (OperationalError, InterfaceError) as error:
        return [error] * len(pushes)
    except Exception as error:  # noqa: BLE001 - answered to the batch that caused it, once it is found
        if len(pushes) == 1:
            push = pushes[0]
            logger.warning("a token batch failed at the database (job %s, seq %s): %r", push.job_id, push.seq, error)
            return [
                bad_request(
                    f"Batch {push.seq} of job {push.job_id} could not be stored ({type(error).__name__}); "
                    "it is refused.",
                    code="batch_unstorable",
                )
            ]
    half = len(pushes) // 2
    return [*await _applied(pushes[:half]), *await _applied(pushes[half:])]


_writers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PushWriter] = weakref.WeakKeyDictionary()


async def push_tokens(
    *,
    host: Host,
    job_id: int,
    seq: int,
    text: str,
    logprobs: list[dict] | None = None,
    finish_reason: str = "",
) -> services.PushResult:
    """Apply one batch through this event loop's writer; raises the batch's refusal."""
    loop = asyncio.get_running_loop()
    writer = _writers.get(loop)
    if writer is None:
        writer = _writers[loop] = PushWriter()
    return await writer.push(
        services.Push(host=host, job_id=job_id, seq=seq, text=text, logprobs=logprobs, finish_reason=finish_reason)
    )
