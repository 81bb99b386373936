"""A local HTTP server that speaks Stripe's wire format for the two calls we make,
plus a signer that signs webhook bodies exactly as Stripe does.

Requests arrive form-encoded (`line_items[0][price_data][unit_amount]=500`);
answers are Stripe's JSON objects. The test points STRIPE_API_BASE at it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl


@dataclass
class Received:
    path: str
    form: dict[str, str]
    idempotency_key: str | None
    authorization: str


@dataclass
class FakeStripe:
    url: str = ""
    received: list[Received] = field(default_factory=list)
    sessions: dict[str, dict] = field(default_factory=dict)
    transfers_by_key: dict[str, dict] = field(default_factory=dict)
    refuse_transfers: bool = False
    server: ThreadingHTTPServer | None = None

    def answer(self, path: str, form: dict[str, str], idempotency_key: str | None) -> tuple[int, dict]:
        if path == "/v1/checkout/sessions":
            session_id = f"cs_test_{uuid.uuid4().hex}"
            session = {
                "id": session_id,
                "object": "checkout.session",
                "amount_total": int(form["line_items[0][price_data][unit_amount]"]) * int(form["line_items[0][quantity]"]),
                "currency": form["line_items[0][price_data][currency]"],
                "client_reference_id": form.get("client_reference_id"),
                "metadata": {"topup_id": form.get("metadata[topup_id]")},
                "mode": form["mode"],
                "payment_status": "unpaid",
                "payment_intent": f"pi_test_{uuid.uuid4().hex[:24]}",
                "status": "open",
                "url": f"https://checkout.stripe.test/c/pay/{session_id}",
            }
            self.sessions[session_id] = session
            return 200, session
        if path == "/v1/transfers":
            if self.refuse_transfers:
                return 400, {"error": {"type": "invalid_request_error", "code": "balance_insufficient",
                                       "message": "You have insufficient available funds in your Stripe account."}}
            if idempotency_key in self.transfers_by_key:  # Stripe replays the first answer
                return 200, self.transfers_by_key[idempotency_key]
            transfer = {
                "id": f"tr_{uuid.uuid4().hex[:24]}",
                "object": "transfer",
                "amount": int(form["amount"]),
                "currency": form["currency"],
                "destination": form["destination"],
                "metadata": {"payout_id": form.get("metadata[payout_id]")},
            }
            self.transfers_by_key[idempotency_key or transfer["id"]] = transfer
            return 200, transfer
        return 404, {"error": {"type": "invalid_request_error", "message": f"Unrecognized request URL (POST: {path})"}}

    def start(self) -> FakeStripe:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                form = dict(parse_qsl(body, keep_blank_values=True))
                key = self.headers.get("Idempotency-Key")
                fake.received.append(Received(self.path, form, key, self.headers.get("Authorization", "")))
                status, payload = fake.answer(self.path, form, key)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Request-Id", f"req_{uuid.uuid4().hex[:14]}")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def sign(payload: str, secret: str, *, timestamp: int | None = None) -> str:
    """The Stripe-Signature header: t=<unix>,v1=HMAC-SHA256(secret, "<t>.<payload>")."""
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.{payload}".encode(), hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def checkout_completed_event(session: dict, *, event_id: str | None = None, payment_status: str = "paid",
                             event_type: str = "checkout.session.completed", amount_total: int | None = None) -> str:
    """A webhook body as Stripe sends it, for a session it created."""
    obj = {**session, "payment_status": payment_status, "status": "complete"}
    if amount_total is not None:
        obj["amount_total"] = amount_total
    event = {
        "id": event_id or f"evt_{uuid.uuid4().hex[:24]}",
        "object": "event",
        "api_version": "2025-01-27.acacia",
        "created": int(time.time()),
        "type": event_type,
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": None, "idempotency_key": None},
        "data": {"object": obj},
    }
    return json.dumps(event, indent=2)


def _event(event_type: str, obj: dict) -> str:
    return json.dumps({
        "id": f"evt_{uuid.uuid4().hex[:24]}", "object": "event", "api_version": "2025-01-27.acacia",
        "created": int(time.time()), "type": event_type, "livemode": False, "pending_webhooks": 1,
        "request": {"id": None, "idempotency_key": None}, "data": {"object": obj},
    }, indent=2)


def charge_refunded_event(session: dict, *, amount_refunded: int) -> str:
    """`charge.refunded` for the payment of `session` (Stripe's `amount_refunded` is the total so far)."""
    return _event("charge.refunded", {
        "id": f"ch_{session['payment_intent'][8:]}", "object": "charge", "amount": session["amount_total"],
        "amount_refunded": amount_refunded, "currency": session["currency"], "payment_intent": session["payment_intent"],
        "refunded": amount_refunded >= session["amount_total"], "status": "succeeded",
    })


def dispute_event(session: dict, *, amount: int, closed: str | None = None, dispute_id: str = "dp_test_1") -> str:
    """`charge.dispute.created`, or `charge.dispute.closed` with status `closed` ("won", "lost")."""
    return _event("charge.dispute.closed" if closed else "charge.dispute.created", {
        "id": dispute_id, "object": "dispute", "amount": amount, "currency": session["currency"],
        "charge": f"ch_{session['payment_intent'][8:]}", "payment_intent": session["payment_intent"],
        "reason": "fraudulent", "status": closed or "needs_response",
    })
