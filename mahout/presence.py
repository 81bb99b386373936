"""The host's one outbound WebSocket: presence, and the fast path for token batches.

Presence: the socket says "this host is alive" by merely being open. If the mahout
process is killed, its operating system closes the socket and the gateway learns within
a moment that the host's running jobs are dead, so another host can continue them (the
20 s stall rule remains for a host that freezes with its socket open). The connection is
re-opened with bounded backoff if it drops (a line says it was lost, and one that it is back),
and carries a ping every few seconds. Its handshake carries this process's boot id
(``X-Mahout-Boot``, :data:`mahout.api.BOOT_ID`): a restarted host's jobs from its earlier
process end at its new start, not at the stall rule.

Job offers: :meth:`Presence.claim` is the claim long-poll as one frame, answered with
the job the moment one is offered to this host.

Token batches: :meth:`Presence.push_tokens` sends a batch as one frame on the socket (the
host was authenticated when it opened) and waits for the gateway's answer to that
(job, seq). When the socket is down or the answer does not come in time it returns None,
and the caller sends the same batch over HTTP: batches are idempotent by ``seq``. A claim
that gets no answer is made again over HTTP.
"""

from __future__ import annotations

import contextlib
import enum
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mahout.api import BOOT_ID, HostApiError, JobGoneError
from protocol.timing import PRESENCE_RECONNECT_MIN_SECONDS, SOCKET_PUSH_TIMEOUT_SECONDS

PING_INTERVAL_SECONDS = 5.0
RECONNECT_MAX_SECONDS = 30.0
OPEN_TIMEOUT_SECONDS = 10.0
CLAIM_MARGIN_SECONDS = 5.0  # how long past its wait a claim on the socket may take to be answered


class Unanswered(enum.Enum):
    UNANSWERED = "unanswered"


UNANSWERED = Unanswered.UNANSWERED  # the socket gave no answer: use HTTP


def presence_url(server: str) -> str:
    """http(s)://host → ws(s)://host/hosts/ws."""
    base = server.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://") :] + "/hosts/ws"
    if base.startswith("http://"):
        return "ws://" + base[len("http://") :] + "/hosts/ws"
    raise ValueError(f"server URL must start with http:// or https://, got {server!r}")


class Presence:
    """Keeps the presence socket open in a daemon thread until :meth:`stop`."""

    def __init__(self, server: str, token: str, *, out: Callable[[str], None] = print) -> None:
        self.url = presence_url(server)
        self._headers = {
            "Authorization": f"Bearer {token}",
            "X-Mahout-Boot": BOOT_ID,
        }  # the hello: this process's start
        self._out = out
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._socket: Any = None
        self._answers: dict[tuple[int, int], dict] = {}
        self._answered = threading.Condition()
        self._claims = 0
        self._lost = False  # a loss was printed: the next open says the socket is back
        self._thread = threading.Thread(target=self._run, name="mahout-presence", daemon=True)

    def start(self) -> Presence:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=OPEN_TIMEOUT_SECONDS + PING_INTERVAL_SECONDS)

    def _run(self) -> None:
        wait = PRESENCE_RECONNECT_MIN_SECONDS
        while not self._stop.is_set():
            try:
                self._hold_open()
                wait = PRESENCE_RECONNECT_MIN_SECONDS
            except Exception as exc:  # noqa: BLE001 - any failure means: reconnect later
                self.connected.clear()
                self._lost = True
                self._out(f"mahout: presence connection lost ({type(exc).__name__}); retrying in {wait:.0f} s")
            self._stop.wait(wait)
            wait = min(wait * 2, RECONNECT_MAX_SECONDS)

    def _hold_open(self) -> None:
        """Read every frame until the socket closes, the gateway falls silent, or stop."""
        from websockets.sync.client import connect

        with connect(self.url, additional_headers=self._headers, open_timeout=OPEN_TIMEOUT_SECONDS) as socket:
            self._socket = socket
            self.connected.set()
            if self._lost:
                self._lost = False
                self._out("mahout: presence connection back")
            try:
                heard, pinged = time.monotonic(), 0.0
                while not self._stop.is_set():
                    if time.monotonic() - pinged >= PING_INTERVAL_SECONDS:
                        socket.send('{"type": "ping"}')
                        pinged = time.monotonic()
                    try:
                        frame = socket.recv(timeout=0.5)
                    except TimeoutError:
                        if time.monotonic() - heard > PING_INTERVAL_SECONDS + OPEN_TIMEOUT_SECONDS:
                            raise
                        continue
                    heard = time.monotonic()
                    self._answer(frame)
            finally:
                self._socket = None
                self.connected.clear()

    def _answer(self, frame: str | bytes) -> None:
        """File the gateway's answer to a batch (or a claim) where its caller waits for it."""
        message = json.loads(frame)
        kind = message.get("type")
        if kind == "job" or (kind == "error" and "id" in message):
            key: tuple = ("claim", message.get("id"))
        elif kind in ("ack", "error"):
            key = (message.get("job"), message.get("seq"))
        else:
            return
        with self._answered:
            self._answers[key] = message
            self._answered.notify_all()

    def _ask(self, frame: dict, key: tuple, timeout: float) -> dict | None:
        """Send a frame and wait for the answer filed under ``key``; None when the socket is
        down or no answer came in ``timeout``."""
        socket = self._socket
        if socket is None:
            return None
        try:
            socket.send(json.dumps(frame))
        except Exception:  # noqa: BLE001 - a closed socket: the reader thread reconnects
            return None
        with self._answered:
            if not self._answered.wait_for(lambda: key in self._answers, timeout=timeout):
                self._answers.pop(key, None)
                return None
            return self._answers.pop(key)

    def claim(self, *, fingerprint: str, wait: float) -> dict | None | Unanswered:
        """Long-poll for a job on the socket: the job, None when none came in ``wait`` seconds,
        or :data:`UNANSWERED` when the socket is down or silent (claim over HTTP instead).
        Raises :class:`HostApiError` for the gateway's refusals (paused, maintenance, …)."""
        with self._answered:
            self._claims += 1
            claim_id = self._claims
        answer = self._ask(
            {"type": "claim", "id": claim_id, "fingerprint": fingerprint, "wait": wait},
            ("claim", claim_id),
            wait + CLAIM_MARGIN_SECONDS,
        )
        if answer is None:
            return UNANSWERED
        if answer["type"] == "job":
            return answer.get("job")
        raise _refusal(answer)

    def push_tokens(
        self,
        job_id: int,
        *,
        seq: int,
        text: str,
        logprobs: list[dict] | None = None,
        finish_reason: str = "",
        timeout: float = SOCKET_PUSH_TIMEOUT_SECONDS,
    ) -> dict | None:
        """Send batch ``seq`` of a job on the socket and return the gateway's ack; raise
        :class:`JobGoneError` (409) or :class:`HostApiError` as the HTTP API would; None when
        the socket is down or no answer came in ``timeout`` (send it over HTTP instead)."""
        frame = {"type": "tokens", "job": job_id, "seq": seq, "text": text}
        if logprobs is not None:
            frame["logprobs"] = logprobs
        if finish_reason:
            frame["finish_reason"] = finish_reason
        answer = self._ask(frame, (job_id, seq), timeout)
        if answer is None:
            return None
        if answer["type"] == "ack":
            return {"accepted": answer["accepted"], "next_seq": answer["next_seq"]}
        raise _refusal(answer)


def _refusal(answer: dict) -> HostApiError:
    """The gateway's error frame as the HTTP API's error (409: the job is no longer ours)."""
    cls = JobGoneError if answer.get("status") == 409 else HostApiError
    return cls(int(answer.get("status") or 400), str(answer.get("message") or ""), "", str(answer.get("code") or ""))


@contextlib.contextmanager
def presence(server: str, token: str, *, out: Callable[[str], None] = print) -> Iterator[Presence]:
    keeper = Presence(server, token, out=out).start()
    try:
        yield keeper
    finally:
        keeper.stop()
