"""HTTP client for the gateway's host API (``/hosts/api/``).

Every call has a timeout. Connection errors and 5xx answers are retried a bounded number
of times with exponential backoff and jitter; the wait is computed inside the ``except``
and slept in the loop, never in the handler. A 4xx answer is not retried: it raises
:class:`HostApiError` carrying the server's ``{"error": {"message", "type", "code"}}``.

Retrying a token push resends the same body, hence the same ``seq``: the server dedupes.

Every heartbeat and claim carries :data:`BOOT_ID`, drawn at random when this process
starts: a gateway that sees a new one for this host ends the jobs its earlier process
was running at once (they would otherwise fill its claim slots until the stall rule),
and continues them elsewhere.
"""

from __future__ import annotations

import base64
import random
import secrets
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from protocol.timing import API_BACKOFF_CAP_SECONDS, API_BACKOFF_SECONDS, API_RETRIES

DEFAULT_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 5.0
CLAIM_TIMEOUT_MARGIN_SECONDS = 10.0
BOOT_ID = secrets.token_hex(8)  # this process's start; every HostApi and socket of the process shares it


class HostApiError(Exception):
    """The server refused a call (4xx); carries its status and error body."""

    def __init__(self, status: int, message: str, type_: str = "", code: str = "") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.type = type_
        self.code = code


class JobGoneError(HostApiError):
    """409: the job is no longer running for this host (cancelled, failed, reassigned)."""


class ServerUnavailable(Exception):
    """The server could not be reached (or kept answering 5xx) after every retry."""


class _Retry:
    """Marker for an attempt that may be retried, with the reason for the final error."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _error_from(response: httpx.Response) -> HostApiError:
    """Build the typed error for a 4xx answer, tolerating a body that is not our format."""
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    if not isinstance(error, dict):
        error = {"message": str(error)}
    cls = JobGoneError if response.status_code == 409 else HostApiError
    return cls(
        response.status_code,
        str(error.get("message") or response.text[:200] or response.reason_phrase),
        str(error.get("type") or ""),
        str(error.get("code") or ""),
    )


class TokenSocket(Protocol):
    """A faster path for token batches (``mahout.presence.Presence``): an answer, or None."""

    def push_tokens(
        self,
        job_id: Any,
        *,
        seq: int,
        text: str,
        logprobs: list[dict] | None = None,
        finish_reason: str = "",
    ) -> dict | None: ...

    def claim(self, *, fingerprint: str, wait: float) -> object:
        """The job, None (nothing came), or anything else when the socket gave no answer."""


class HostApi:
    """One host's authenticated session with the gateway.

    ``retries`` is the number of extra attempts after the first; the wait before retry
    ``n`` (0-based) is ``min(backoff_cap, backoff * 2**n)`` scaled by a jitter in [0.5, 1].
    ``sleep`` and ``transport`` are injectable for tests.
    """

    def __init__(
        self,
        server: str,
        token: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retries: int = API_RETRIES,
        backoff: float = API_BACKOFF_SECONDS,
        backoff_cap: float = API_BACKOFF_CAP_SECONDS,
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self._sleep = sleep
        self._socket: TokenSocket | None = None
        self._client = httpx.Client(
            base_url=server.rstrip("/") + "/hosts/api",
            headers={"Authorization": f"Bearer {token}"},
            transport=transport,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def backoff_delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based), jittered."""
        base = min(self.backoff_cap, self.backoff * (2**attempt))
        return base * random.uniform(0.5, 1.0)

    def _attempt(self, method: str, path: str, body: Any, timeout: httpx.Timeout) -> httpx.Response | _Retry:
        """Send once; return the response, a retry marker, or raise for a 4xx."""
        try:
            response = self._client.request(method, path, json=body, timeout=timeout)
        except httpx.TransportError as exc:
            return _Retry(f"{type(exc).__name__}: {exc}")
        if response.status_code >= 500:
            return _Retry(f"HTTP {response.status_code}")
        if response.status_code >= 400:
            raise _error_from(response)
        return response

    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> httpx.Response:
        """Send with bounded retries; raise :class:`ServerUnavailable` when they run out."""
        seconds = self.timeout if timeout is None else timeout
        call_timeout = httpx.Timeout(seconds, connect=min(CONNECT_TIMEOUT_SECONDS, seconds))
        attempt = 0
        while True:
            outcome = self._attempt(method, path, body, call_timeout)
            if not isinstance(outcome, _Retry):
                return outcome
            if attempt >= self.retries:
                raise ServerUnavailable(f"{method} {path} failed after {attempt + 1} attempts: {outcome.reason}")
            self._sleep(self.backoff_delay(attempt))
            attempt += 1

    @staticmethod
    def _json(response: httpx.Response) -> dict:
        """Decode a JSON body; an empty body is ``{}``."""
        return response.json() if response.content else {}

    def register_qualification(
        self,
        *,
        model: str,
        fingerprint: str,
        benchmark: dict,
        machine: dict,
        sha256: str = "",
    ) -> dict:
        """Record that ``model`` (the file with that sha256) was benchmarked on this machine; the
        server lets us claim it."""
        body = {"model": model, "fingerprint": fingerprint, "benchmark": benchmark, "machine": machine}
        if sha256:
            body["sha256"] = sha256
        return self._json(self._request("POST", "/qualifications", body))

    def heartbeat(
        self,
        *,
        fingerprint: str,
        paused: bool,
        active_jobs: list,
        models_loaded: list[str],
        version: str,
        catalog: dict | None = None,
    ) -> dict:
        """Tell the server we are alive, whether we are paused, and what we are doing.

        ``catalog`` (``installed``, ``qualified``, ``loaded``, ``slots``, ``active_jobs``,
        ``memory_budget_mb``) is what warm-first routing and ``/v1/models`` read.
        """
        body = {
            "fingerprint": fingerprint,
            "paused": paused,
            "active_jobs": active_jobs,
            "models_loaded": models_loaded,
            "version": version,
            "boot": BOOT_ID,
        }
        if catalog is not None:
            body["catalog"] = catalog
        return self._json(self._request("POST", "/heartbeat", body))

    def claim(self, *, fingerprint: str, wait: float) -> dict | None:
        """Long-poll for a job for up to ``wait`` seconds; ``None`` when nothing arrived (204).

        On the host's WebSocket when it is up (the job is sent the moment it is offered);
        over HTTP when it is not, or gave no answer."""
        if self._socket is not None:
            answer = self._socket.claim(fingerprint=fingerprint, wait=wait)
            if answer is None or isinstance(answer, dict):
                return answer
        body = {"fingerprint": fingerprint, "wait": wait, "boot": BOOT_ID}
        response = self._request("POST", "/claim", body, timeout=wait + CLAIM_TIMEOUT_MARGIN_SECONDS)
        if response.status_code == 204 or not response.content:
            return None
        return response.json().get("job")

    def use_socket(self, socket: TokenSocket | None) -> None:
        """Claim jobs and send token batches on this host's WebSocket when it is up (HTTP otherwise)."""
        self._socket = socket

    def push_tokens(
        self,
        job_id: Any,
        *,
        seq: int,
        text: str,
        logprobs: list[dict] | None = None,
        finish_reason: str = "",
    ) -> dict:
        """Append batch ``seq`` of generated text (with its tokens' log-probability entries
        when the job asked for them); raises :class:`JobGoneError` on 409. ``finish_reason``
        marks the answer's last batch: should this process die before "complete", the
        gateway settles the answer instead of having another host continue it.

        On the host's WebSocket when it is up (authenticated once per connection); over
        HTTP when it is not, or gave no answer (the same ``seq``, so never applied twice)."""
        if self._socket is not None:
            answer = self._socket.push_tokens(
                job_id, seq=seq, text=text, logprobs=logprobs, finish_reason=finish_reason
            )
            if answer is not None:
                return answer
        body: dict = {"seq": seq, "text": text}
        if logprobs is not None:
            body["logprobs"] = logprobs
        if finish_reason:
            body["finish_reason"] = finish_reason
        return self._json(self._request("POST", f"/jobs/{job_id}/tokens", body))

    def complete(
        self,
        job_id: Any,
        *,
        finish_reason: str,
        completion_tokens: int,
        tokens: list[int] | None = None,
        seed: int | None = None,
    ) -> dict:
        """Report the job finished; the answer carries what we earned. ``tokens`` (every token id
        sampled) and ``seed`` (the one sampled with) let the gateway audit the answer
        (`scorer.verify`); a runner that has neither sends neither."""
        body: dict[str, Any] = {"finish_reason": finish_reason, "completion_tokens": completion_tokens}
        if tokens is not None:
            body["tokens"] = tokens
        if seed is not None:
            body["seed"] = seed
        return self._json(self._request("POST", f"/jobs/{job_id}/complete", body))

    def complete_embeddings(self, job_id: Any, *, embeddings: list[list[float]]) -> dict:
        """Report an embeddings job done with its vectors (one per input, in order)."""
        body = {"finish_reason": "stop", "embeddings": embeddings}
        return self._json(self._request("POST", f"/jobs/{job_id}/complete", body))

    def progress(self, job_id: Any, *, stage: str) -> dict:
        """Still loading (``stage="loading"``) or prefilling (``"prefill"``) the job, no token yet."""
        return self._json(self._request("POST", f"/jobs/{job_id}/progress", {"stage": stage}))

    def fail(self, job_id: Any, *, reason: str, cause: str = "host") -> dict:
        """Report the job failed on this host, so the gateway can fail over at once; ``cause``
        "request" says the job's own content cannot be run (no strike against this host)."""
        return self._json(self._request("POST", f"/jobs/{job_id}/fail", {"reason": reason, "cause": cause}))

    def audit_verdict(self, audit_id: Any, verdict: dict) -> dict:
        """Report the verdict on an audit this trusted host scored (`protocol.jobs.AuditVerdict`);
        the answer says the audit's status after it."""
        return self._json(self._request("POST", f"/audits/{audit_id}/verdict", verdict))

    def ring_inquiries(self, ring_id: int, stage: int) -> list[dict]:
        """The ring inquiries this host's stage owes its evidence to (`mahout.ring.evidence`):
        each ``{"id", "job"}``."""
        return self._json(self._request("GET", f"/ring-inquiries?ring={int(ring_id)}&stage={int(stage)}")).get(
            "inquiries", []
        )

    def ring_evidence_send(self, inquiry_id: int, *, stage: int, part: int, parts: int, data: bytes) -> dict:
        """One part of this stage's evidence for an inquiry (``parts`` 0: it kept nothing)."""
        body = {"stage": stage, "part": part, "parts": parts, "data": base64.b64encode(data).decode("ascii")}
        return self._json(self._request("POST", f"/ring-inquiries/{int(inquiry_id)}/evidence", body))

    def ring_evidence(self, inquiry_id: int, *, stage: int, part: int) -> bytes:
        """One part of a stage's evidence, for the inquiry's checker (this host)."""
        answer = self._json(
            self._request("GET", f"/ring-inquiries/{int(inquiry_id)}/evidence?stage={int(stage)}&part={int(part)}")
        )
        return base64.b64decode(answer["data"])

    def ring_check_verdict(self, inquiry_id: int, verdict: dict) -> dict:
        """The verdict of a ring check this trusted host ran: ``{"verdict": "blamed", "blamed": [...],
        "reasons": [...]}`` or ``{"verdict": "declined", "reasons": [why]}``."""
        return self._json(self._request("POST", f"/ring-inquiries/{int(inquiry_id)}/verdict", verdict))

    def catalog(self) -> list[dict]:
        """What the gateway's catalog sells: per model its name, kind and the one file it means
        (``sha256``, ``quantization``, ``file_size``), ``context_length``, ``embedding_dimensions``."""
        models = self._json(self._request("GET", "/catalog")).get("models")
        return [entry for entry in models if isinstance(entry, dict)] if isinstance(models, list) else []

    def me(self) -> dict:
        """This host's record as the server sees it."""
        return self._json(self._request("GET", "/me"))

    def earnings(self) -> dict:
        """This host's earnings summary."""
        return self._json(self._request("GET", "/earnings"))
