"""The host's WebSocket: its presence, its job offers and the fast path for its token batches
(`HostSocketConsumer`)."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime

from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from core.db import db
from core.errors import ApiError, DomainError, bad_request, validation_error
from core.http import scope_bearer
from core.parsers import json_loads
from core.secrets import secret_hash
from hosts.models import Host
from hosts.selectors import host_for_socket, host_from_secret
from hosts.services import host_socket_opened, host_token_group
from marketplace import services
from marketplace.hostdoor import pushing
from marketplace.hostdoor.claiming import BOOT_PATTERN, JobClaimInputSerializer, claim_when_offered


class HostSocketConsumer(AsyncJsonWebsocketConsumer):
    """A host's one WebSocket: its presence, and the fast path for its token batches.

    Presence: mahout keeps this socket open while it runs. A killed process's sockets
    are closed by its operating system, so the gateway sees the disconnect within a
    moment and, unless the host reconnects within HOST_RECONNECT_GRACE_SECONDS (its
    socket dropped for another reason: the network, a gateway process restarting),
    declares the host's running attempts dead (they are continued elsewhere) instead
    of waiting out the 20 s stall rule. A frozen host keeps its
    socket open; the stall rule catches that one. One mahout process per host token:
    a second connection's end would count as the host's death.

    Token batches: the host is authenticated once, when the socket opens; then each
    `{"type": "tokens", "job", "seq", "text"}` frame (with `logprobs` and `finish_reason`
    when it has them) is applied by the same service as `POST /hosts/api/jobs/<id>/tokens`
    and answered with `{"type": "ack", "job", "seq", "accepted", "next_seq"}` or
    `{"type": "error", "job", "seq", "status", "code", "message"}`. Frames are handled
    concurrently (a host's jobs do not wait for each other); a host sends a job's next batch
    only after the previous one's answer, so each job's batches stay in order.

    Job offers: a `{"type": "claim", "id", "fingerprint", "wait"}` frame is the long-poll of
    `POST /hosts/api/claim` on the socket, answered `{"type": "job", "id", "job": payload}`
    as soon as a job is offered to this host (`"job": null` after `wait` seconds), or an
    error frame carrying the same `id`. A claim still waiting when the socket closes is
    dropped. Anything else is answered `{"type": "pong"}`.

    Restarts: the handshake may carry the process's boot id (`X-Mahout-Boot`); the host's
    attempts claimed under another one end at once (`services.host_boot_seen`), and claims
    on this socket are recorded under it.

    Revocation: the socket joins its token's group (`hosts.services.host_token_group`)
    before it authenticates; a rotation or a ban closes it (4401, 4403). A claim frame
    re-reads the host with the same refusals as HTTP (`host_for_socket`).
    """

    host_id: int | None = None

    async def dispatch(self, message: dict) -> None:
        """Channels' dispatch, without its per-message `aclose_old_connections` (a thread hop
        per frame). This consumer never touches the database in its own thread: every query
        runs through `db()`, which tidies the pool thread's connection around it."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def connect(self) -> None:
        token = scope_bearer(self.scope)
        try:
            if token is None:
                raise ApiError(401, "missing host token", code="missing_host_token")
            self._token_hash = secret_hash(token)
            self.groups = [host_token_group(self._token_hash)]  # channels leaves `self.groups` on disconnect
            await self.channel_layer.group_add(self.groups[0], self.channel_name)
            boot = scope_boot(self.scope)
            host, self._opened = await db(_socket_host, token, boot)
        except DomainError as error:
            await self.close(code=error.ws_close_code)
            return
        self.host_id = host.pk
        self._host = host
        self._boot = boot
        self._tasks: set[asyncio.Task] = set()
        await self.accept()

    async def receive_json(self, content: object, **kwargs: object) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind in ("tokens", "claim"):
            assert isinstance(content, dict)
            task = asyncio.ensure_future(self._push(content) if kind == "tokens" else self._claim(content))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        await self.send_json({"type": "pong"})

    async def _claim(self, frame: dict) -> None:
        """A long-poll on the socket: answered `{"type": "job", "id", "job": payload or null}`."""
        claim_id = frame.get("id")
        try:
            fingerprint, wait = claim_frame(frame)
            host = await db(
                host_for_socket, host_id=self.host_id, token_hash=self._token_hash
            )  # paused, rested, banned since?
            payload = await claim_when_offered(host, fingerprint=fingerprint, wait=wait, boot=self._boot)
            answer: dict = {"type": "job", "id": claim_id, "job": payload}
        except DomainError as error:
            answer = error.frame(id=claim_id)
        await self.send_json(answer)

    async def _push(self, frame: dict) -> None:
        job_id, seq = frame.get("job"), frame.get("seq")
        try:
            batch = tokens_frame(frame)
            result = await pushing.push_tokens(host=self._host, **batch)
            answer = {
                "type": "ack",
                "job": job_id,
                "seq": seq,
                "accepted": result.accepted,
                "next_seq": result.next_seq,
            }
        except DomainError as error:
            answer = error.frame(job=job_id, seq=seq)
        await self.send_json(answer)

    async def host_token_revoked(self, message: dict) -> None:
        """The token this socket opened with was rotated or revoked (a ban): close at once
        (a socket its connect refused is closed already)."""
        if self.host_id is not None:
            await self.close(code=message.get("code", 4401))

    async def disconnect(self, code: int) -> None:
        """A host that does not reopen its socket within HOST_RECONNECT_GRACE_SECONDS is dead.
        (A gateway process that is killed never gets here: its hosts simply reconnect.)"""
        for task in list(getattr(self, "_tasks", ())):
            task.cancel()  # a claim still waiting must not take a job nobody will hear of
        if self.host_id is not None:
            await asyncio.sleep(settings.HOST_RECONNECT_GRACE_SECONDS)
            await db(services.host_connection_lost, host_id=self.host_id, opened_at=self._opened)

    async def decode_json(self, text_data: str) -> object:
        try:
            return json_loads(text_data)
        except ValueError:  # not JSON, NaN / Infinity, or nested too deep: refused as "not one JSON object"
            return None


def _socket_host(token: str, boot: str) -> tuple[Host, datetime]:
    """The host a socket's token belongs to, and when this socket opened (one trip to the
    pool); a new boot id ends its earlier process's attempts first."""
    host = host_from_secret(token)
    services.host_boot_seen(host_id=host.pk, boot=boot)
    return host, host_socket_opened(host_id=host.pk)


def scope_boot(scope: dict) -> str:
    """The boot id a host's handshake carries (`X-Mahout-Boot`), "" without one; a malformed
    one refuses the socket, as the HTTP doors refuse it."""
    raw = dict(scope.get("headers") or []).get(b"x-mahout-boot", b"")
    boot = raw.decode("latin-1")
    if len(boot) > 64 or not re.fullmatch(BOOT_PATTERN, boot):
        raise bad_request(
            "X-Mahout-Boot must be at most 64 letters, digits, '-' or '_'.", code="invalid_value", param="boot"
        )
    return boot


def claim_frame(frame: dict) -> tuple[str, float]:
    """A claim frame's fingerprint and wait, checked by the HTTP door's serializer."""
    serializer = JobClaimInputSerializer(data={k: v for k, v in frame.items() if k in ("fingerprint", "wait")})
    if not serializer.is_valid():
        raise validation_error(serializer.errors)
    return serializer.validated_data["fingerprint"], serializer.validated_data["wait"]


def tokens_frame(frame: dict) -> dict:
    """A tokens frame's job id, seq, text and the rest, checked by the HTTP door's serializer
    (`TokensFrameSerializer`: the same bounds, the job's id bounded as the HTTP path's)."""
    serializer = pushing.TokensFrameSerializer(data={k: v for k, v in frame.items() if k != "type"})
    if not serializer.is_valid():
        raise validation_error(serializer.errors)
    data = serializer.validated_data
    batch = {"job_id": data["job"], "seq": data["seq"], "text": data["text"]}
    if data.get("finish_reason"):
        batch["finish_reason"] = data["finish_reason"]
    if data.get("logprobs") is not None:  # (checked with the text, where every door's batches are applied)
        batch["logprobs"] = data["logprobs"]
    return batch
