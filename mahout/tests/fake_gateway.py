"""An in-memory test double of the gateway's host API, served over real HTTP on loopback.

It implements the contract mahout codes against (claim long-poll with 204, ordered token
batches deduplicated by ``seq``, 409 once a job is no longer running, complete/fail,
heartbeat, qualifications) plus a few knobs to inject faults. Tests read its state.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from protocol.rendering import ChatFormat
from testkit.formats import BYTES, GEMMA, rendered

TOKEN = "host-token"


class GatewayState:
    """Everything the fake gateway knows; guarded by one condition variable."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: list[dict] = []
        self.status: dict[str, str] = {}  # job id -> running | completed | failed | cancelled
        self.text: dict[str, str] = {}
        self.next_seq: dict[str, int] = {}
        self.pushes: list[tuple[str, int, str, int]] = []  # (job, seq, text, http status)
        self.completions: dict[str, dict] = {}
        self.failures: dict[str, str] = {}
        self.progress: list[tuple[str, str, float]] = []  # (job, stage, when) before the first token
        self.heartbeats: list[dict] = []
        self.causes: dict[str, str] = {}  # job id -> whose fault its failure was, as the host said
        self.qualifications: list[dict] = []
        self.claims = 0
        self.claimed = threading.Event()
        # fault knobs
        self.lose_push_answers = 0  # apply a push, then answer 503 (the answer is "lost")
        self.cancel_after_batches: dict[str, int] = {}
        self.server_paused = False
        self.maintenance = ""  # a reason: claims are refused with 403 host_maintenance
        self.unheard = (
            False  # the next claim is refused with 409 heartbeat_required (the gateway has not heard from us)
        )
        self.asks: dict[str, list[str]] = {"load": [], "unload": []}  # the heartbeat answer's redundancy asks

    def add_job(
        self,
        job_id: str,
        *,
        kind: str = "chat",
        model: str = "gemma-3-270m",
        fmt: ChatFormat | None = None,
        **params: object,
    ) -> None:
        """Queue a job as the gateway would hand it to a host, rendered in `fmt` (default: the
        shipped Gemma's format for it, a byte vocabulary's for any other model)."""
        job = {
            "id": job_id,
            "model": model,
            "kind": kind,
            "messages": [{"role": "user", "content": "hi"}] if kind == "chat" else None,
            "prompt": "Once upon" if kind == "completion" else None,
            "params": {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": None, **params},
        }
        job = rendered(job, fmt or (GEMMA if model == "gemma-3-270m" else BYTES))  # the gateway renders what it sends
        with self.cond:
            self.queue.append(job)
            self.cond.notify_all()


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *_args: object) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: dict | None = None) -> None:
        payload = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, status: int, message: str, code: str) -> None:
        self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": code}})

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/hosts/api/me":
            self._send(
                200,
                {
                    "id": 7,
                    "name": "test-host",
                    "status": "online",
                    "paused": False,
                    "maintenance_reason": None,
                    "active_jobs": [{"id": 42, "model": "gemma-3-270m", "claimed_at": "2026-12-02T14:00:00Z"}],
                },
            )
        elif self.path == "/hosts/api/earnings":
            earned = sum(c.get("earned_ucents", 0) for c in self.server.state.completions.values())
            self._send(
                200,
                {
                    "balance_ucents": 2_500_000 + earned,
                    "payable_ucents": 2_000_000,
                    "unvested_ucents": 500_000 + earned,
                    "today_ucents": 1_234_567 + earned,
                    "lines": [],
                },
            )
        else:
            self._error(404, "not found", "not_found")

    def do_POST(self) -> None:
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        parts = self.path.removeprefix("/hosts/api/").split("/")
        state = self.server.state
        if parts == ["claim"]:
            self._claim(state, body)
        elif parts == ["heartbeat"]:
            with state.cond:
                state.heartbeats.append(body)
            self._send(200, {"status": "ok", "paused": body["paused"] or state.server_paused, **state.asks})
        elif parts == ["qualifications"]:
            state.qualifications.append(body)
            self._send(201, {"model": body["model"], "fingerprint": body["fingerprint"]})
        elif len(parts) == 3 and parts[0] == "jobs":
            getattr(self, f"_job_{parts[2]}")(state, parts[1], body)
        else:
            self._error(404, "not found", "not_found")

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        self._error(401, "bad host token", "invalid_token")
        return False

    def _claim(self, state: GatewayState, body: dict) -> None:
        if state.unheard:
            state.claims += 1
            state.unheard = False
            self._error(409, "This host has not sent a heartbeat in the last 30 seconds.", "heartbeat_required")
            return
        if state.maintenance:
            state.claims += 1
            self._error(403, f"This host is in maintenance: {state.maintenance}", "host_maintenance")
            return
        with state.cond:
            state.claims += 1
            state.cond.wait_for(lambda: state.queue, timeout=float(body["wait"]))
            job = state.queue.pop(0) if state.queue else None
            if job is not None:
                state.status[job["id"]] = "running"
                state.text[job["id"]] = ""
                state.next_seq[job["id"]] = 0
        if job is None:
            self._send(204)
            return
        state.claimed.set()
        self._send(200, {"job": job})

    def _job_tokens(self, state: GatewayState, job_id: str, body: dict) -> None:
        with state.cond:
            if state.status.get(job_id) != "running":
                state.pushes.append((job_id, body["seq"], body["text"], 409))
                self._error(409, "job is not running", "job_not_running")
                return
            accepted = body["seq"] == state.next_seq[job_id]
            if accepted:
                state.text[job_id] += body["text"]
                state.next_seq[job_id] += 1
            lose = state.lose_push_answers > 0
            state.lose_push_answers -= int(lose)
            status = 503 if lose else 200
            state.pushes.append((job_id, body["seq"], body["text"], status))
            if state.cancel_after_batches.get(job_id) == state.next_seq[job_id]:
                state.status[job_id] = "cancelled"
        if lose:
            self._error(503, "try again", "unavailable")
        else:
            self._send(200, {"accepted": accepted, "next_seq": state.next_seq[job_id]})

    def _job_complete(self, state: GatewayState, job_id: str, body: dict) -> None:
        with state.cond:
            if state.status.get(job_id) != "running":
                self._error(409, "job is not running", "job_not_running")
                return
            state.status[job_id] = "completed"
            state.completions[job_id] = {**body, "earned_ucents": 80 * body["completion_tokens"]}
        self._send(200, {"earned_ucents": 80 * body["completion_tokens"]})

    def _job_progress(self, state: GatewayState, job_id: str, body: dict) -> None:
        with state.cond:
            if state.status.get(job_id) != "running":
                self._error(409, "job is not running", "job_not_running")
                return
            state.progress.append((job_id, body.get("stage", ""), time.monotonic()))
        self._send(200, {"ok": True})

    def _job_fail(self, state: GatewayState, job_id: str, body: dict) -> None:
        with state.cond:
            state.status[job_id] = "failed"
            state.failures[job_id] = body["reason"]
            state.causes[job_id] = body.get("cause", "host")
        self._send(200, {"status": "failed"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: GatewayState


class FakeGateway:
    """Context manager: a running fake gateway; ``url`` and ``state`` for the test."""

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = GatewayState()
        self.state = self._server.state
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> FakeGateway:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
