"""Local test mode: a stand-in for Stripe's servers, for `make run` and the tests.

It speaks Stripe's wire format to the unmodified `stripe` library (requests arrive
form-encoded, `line_items[0][price_data][unit_amount]=500`; answers are Stripe's JSON
objects; an `Idempotency-Key` replays the first answer), so the gateway runs the same
code path as against live Stripe (`billing/stripe_api.py`, `billing/webhooks.py`).
The calls it knows are the ones we make: Checkout Sessions, Transfers, Connect
accounts (create, retrieve) and account links.

Besides the API it serves the two pages a browser is sent to:
- `/c/pay/<session>`: the Checkout page. "Pay" sends `checkout.session.completed` to
  the gateway's webhook endpoint, signed as Stripe signs (`Stripe-Signature:
  t=<unix>,v1=<HMAC-SHA256>`), then redirects to the session's `success_url`;
  "Cancel" redirects to its `cancel_url`.
- `/connect/onboarding/<link>`: Connect onboarding. "Complete" marks the account
  as Stripe does once its owner finished (details submitted, payouts enabled), sends
  Connect's signed `account.updated` to the webhook URL, and redirects to the link's
  `return_url`, where the gateway retrieves the account.

No money moves and nothing leaves the machine. `python manage.py stripe_local` runs it
(`make run` starts it when no real Stripe key is set). Given a `state_path`, its sessions,
accounts, links and replays survive a restart: written there atomically after each change,
read back at `start`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import html
import json
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import httpx

API_VERSION = "2025-01-27.acacia"
WEBHOOK_TIMEOUT_SECONDS = 10.0
ACCOUNT_LINK_SECONDS = 300  # Stripe's account links expire after a few minutes, and work once


def _id(prefix: str, length: int = 24) -> str:
    return f"{prefix}_{secrets.token_hex(length // 2)}"


def sign(payload: str, secret: str, *, timestamp: int | None = None) -> str:
    """The Stripe-Signature header: t=<unix>,v1=HMAC-SHA256(secret, "<t>.<payload>")."""
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.{payload}".encode(), hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def event_body(event_type: str, obj: dict, *, event_id: str | None = None) -> str:
    """A webhook body as Stripe sends it: an `event` wrapping the object it is about."""
    return json.dumps(
        {
            "id": event_id or _id("evt"),
            "object": "event",
            "api_version": API_VERSION,
            "created": int(time.time()),
            "type": event_type,
            "livemode": False,
            "pending_webhooks": 1,
            "request": {"id": None, "idempotency_key": None},
            "data": {"object": obj},
        },
        indent=2,
    )


def checkout_completed_event(
    session: dict,
    *,
    event_id: str | None = None,
    payment_status: str = "paid",
    event_type: str = "checkout.session.completed",
    amount_total: int | None = None,
) -> str:
    """The event Stripe sends when a session it created is paid."""
    obj = {**session, "payment_status": payment_status, "status": "complete"}
    if amount_total is not None:
        obj["amount_total"] = amount_total
    return event_body(event_type, obj, event_id=event_id)


def charge_refunded_event(session: dict, *, amount_refunded: int) -> str:
    """`charge.refunded` for the payment of `session` (Stripe's `amount_refunded` is the total so far)."""
    return event_body(
        "charge.refunded",
        {
            "id": f"ch_{session['payment_intent'][8:]}",
            "object": "charge",
            "amount": session["amount_total"],
            "amount_refunded": amount_refunded,
            "currency": session["currency"],
            "payment_intent": session["payment_intent"],
            "refunded": amount_refunded >= session["amount_total"],
            "status": "succeeded",
        },
    )


def dispute_event(session: dict, *, amount: int, closed: str | None = None, dispute_id: str = "dp_test_1") -> str:
    """`charge.dispute.created`, or `charge.dispute.closed` with status `closed` ("won", "lost")."""
    return event_body(
        "charge.dispute.closed" if closed else "charge.dispute.created",
        {
            "id": dispute_id,
            "object": "dispute",
            "amount": amount,
            "currency": session["currency"],
            "charge": f"ch_{session['payment_intent'][8:]}",
            "payment_intent": session["payment_intent"],
            "reason": "fraudulent",
            "status": closed or "needs_response",
        },
    )


@dataclass
class Received:
    """One API call as it arrived (tests read what the gateway sent)."""

    method: str
    path: str
    form: dict[str, str]
    idempotency_key: str | None
    authorization: str


def _error(
    status: int, message: str, *, code: str | None = None, kind: str = "invalid_request_error"
) -> tuple[int, dict]:
    return status, {"error": {"type": kind, "code": code, "message": message}}


@dataclass
class LocalStripe:
    """The stand-in. `secret_key` is the one API key it accepts (empty: any test key,
    `sk_test_…`); `webhook_url` and `webhook_secret` are where "Pay" delivers, and the
    secret it signs with (the gateway's STRIPE_WEBHOOK_SECRET); `state_path` is the JSON file
    its state lives in across restarts (None: in memory only)."""

    secret_key: str = ""
    webhook_url: str = ""
    webhook_secret: str = ""
    url: str = ""
    received: list[Received] = field(default_factory=list)
    sessions: dict[str, dict] = field(default_factory=dict)
    accounts: dict[str, dict] = field(default_factory=dict)
    links: dict[str, dict] = field(default_factory=dict)
    events: dict[str, str] = field(default_factory=dict)  # a paid session's event, resent as is when paid again
    replays: dict[str, tuple[int, dict]] = field(default_factory=dict)
    refuse_transfers: bool = False
    state_path: Path | None = None
    server: ThreadingHTTPServer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    # --- the API ---------------------------------------------------------------------

    def authorized(self, authorization: str) -> bool:
        key = authorization.removeprefix("Bearer ").strip()
        return key == self.secret_key if self.secret_key else key.startswith("sk_test_")

    def api(self, method: str, path: str, form: dict[str, str], idempotency_key: str | None) -> tuple[int, dict]:
        """Answer one API call; a repeated `Idempotency-Key` gets the first answer again, as Stripe does."""
        # keys are scoped to the account (here: the secret key) as Stripe scopes them, so a run
        # of `make run` with fresh keys never replays an answer saved by an earlier run
        scoped = f"{self.secret_key}|{idempotency_key}" if idempotency_key else None
        with self.lock:
            if method == "POST" and scoped and scoped in self.replays:
                return self.replays[scoped]
            answer = self._route(method, path, form)
            if method == "POST" and scoped and answer[0] < 500:
                self.replays[scoped] = answer
            if method == "POST":
                self._save()
            return answer

    def _route(self, method: str, path: str, form: dict[str, str]) -> tuple[int, dict]:
        if (method, path) == ("POST", "/v1/checkout/sessions"):
            return self._session_create(form)
        if (method, path) == ("POST", "/v1/transfers"):
            return self._transfer_create(form)
        if (method, path) == ("POST", "/v1/accounts"):
            return self._account_create(form)
        if (method, path) == ("POST", "/v1/account_links"):
            return self._account_link_create(form)
        found = re.fullmatch(r"/v1/(accounts|checkout/sessions)/([\w-]+)", path)
        if method == "GET" and found:
            objects = self.accounts if found.group(1) == "accounts" else self.sessions
            if found.group(2) in objects:
                return 200, objects[found.group(2)]
            return _error(
                404, f"No such {found.group(1).split('/')[-1].rstrip('s')}: '{found.group(2)}'", code="resource_missing"
            )
        return _error(404, f"Unrecognized request URL ({method}: {path}).")

    def _session_create(self, form: dict[str, str]) -> tuple[int, dict]:
        missing = [
            name for name in ("mode", "success_url", "line_items[0][price_data][unit_amount]") if not form.get(name)
        ]
        if missing:
            return _error(400, f"Missing required param: {missing[0]}.", code="parameter_missing")
        session_id = _id("cs_test", 58)
        session = {
            "id": session_id,
            "object": "checkout.session",
            "amount_total": int(form["line_items[0][price_data][unit_amount]"])
            * int(form.get("line_items[0][quantity]", "1")),
            "currency": form.get("line_items[0][price_data][currency]", "usd"),
            "client_reference_id": form.get("client_reference_id"),
            "customer_email": form.get("customer_email"),
            "metadata": {key[9:-1]: value for key, value in form.items() if key.startswith("metadata[")},
            "mode": form["mode"],
            "payment_status": "unpaid",
            "payment_intent": _id("pi_test"),
            "status": "open",
            "success_url": form["success_url"],
            "cancel_url": form.get("cancel_url"),
            "url": f"{self.url}/c/pay/{session_id}",
        }
        self.sessions[session_id] = session
        return 200, session

    def _transfer_create(self, form: dict[str, str]) -> tuple[int, dict]:
        if self.refuse_transfers:
            return _error(
                400, "You have insufficient available funds in your Stripe account.", code="balance_insufficient"
            )
        return 200, {
            "id": _id("tr"),
            "object": "transfer",
            "amount": int(form["amount"]),
            "currency": form["currency"],
            "destination": form["destination"],
            "metadata": {key[9:-1]: value for key, value in form.items() if key.startswith("metadata[")},
        }

    def _account_create(self, form: dict[str, str]) -> tuple[int, dict]:
        account_id = _id("acct", 16)
        self.accounts[account_id] = {
            "id": account_id,
            "object": "account",
            "type": form.get("type", "express"),
            "country": form.get("country", "US"),
            "email": form.get("email"),
            "created": int(time.time()),
            "details_submitted": False,
            "charges_enabled": False,
            "payouts_enabled": False,
            "capabilities": {"transfers": "inactive"},
            "requirements": {
                "currently_due": ["external_account", "tos_acceptance.date"],
                "disabled_reason": "requirements.past_due",
            },
            "metadata": {key[9:-1]: value for key, value in form.items() if key.startswith("metadata[")},
        }
        return 200, self.accounts[account_id]

    def _account_link_create(self, form: dict[str, str]) -> tuple[int, dict]:
        if form.get("account") not in self.accounts:
            return _error(400, f"No such account: '{form.get('account')}'", code="resource_missing")
        if form.get("type") not in ("account_onboarding", "account_update"):
            return _error(400, f"Invalid type: {form.get('type')!r}.", code="parameter_invalid")
        link_id = secrets.token_urlsafe(16)
        now = int(time.time())
        self.links[link_id] = {
            "account": form["account"],
            "return_url": form.get("return_url", ""),
            "refresh_url": form.get("refresh_url", ""),
            "expires_at": now + ACCOUNT_LINK_SECONDS,
            "used": False,
        }
        return 200, {
            "object": "account_link",
            "created": now,
            "expires_at": now + ACCOUNT_LINK_SECONDS,
            "url": f"{self.url}/connect/onboarding/{link_id}",
        }

    # --- the pages ---------------------------------------------------------------------

    def checkout_pay(self, session_id: str) -> tuple[str, str]:
        """ "Pay": complete the session and deliver its signed event; (redirect, "") once the
        gateway accepted it, or ("", why) when the delivery failed (paying again resends it)."""
        with self.lock:
            session = self.sessions[session_id]
            session.update(status="complete", payment_status="paid")
            event = self.events.setdefault(session_id, checkout_completed_event(session))
            self._save()
        failure = self.deliver(event)
        return ("", failure) if failure else (session["success_url"], "")

    def deliver(self, payload: str) -> str:
        """POST a signed event to the webhook URL as Stripe does; "" once answered 2xx, else why not."""
        if not self.webhook_url:
            return "no webhook URL is configured (stripe_local --webhook-url)"
        headers = {
            "Content-Type": "application/json; charset=utf-8",
            "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
            "Stripe-Signature": sign(payload, self.webhook_secret),
        }
        try:
            answer = httpx.post(
                self.webhook_url, content=payload.encode(), headers=headers, timeout=WEBHOOK_TIMEOUT_SECONDS
            )
        except httpx.HTTPError as error:
            return f"the webhook to {self.webhook_url} failed: {error}"
        if not answer.is_success:
            return f"the webhook to {self.webhook_url} was answered {answer.status_code}: {answer.text[:300]}"
        return ""

    def onboarding_complete(self, link_id: str) -> str:
        """ "Complete" on the onboarding page: the account can now receive transfers, and
        `account.updated` says so to the webhook URL (a failed delivery is not retried: the
        return URL asks again). Returns the link's return_url (its refresh_url when the link
        expired or was used, as Stripe does)."""
        with self.lock:
            link = self.links[link_id]
            if link["used"] or link["expires_at"] < time.time():
                return link["refresh_url"]
            link["used"] = True
            account = self.accounts[link["account"]]
            account.update(
                details_submitted=True,
                charges_enabled=True,
                payouts_enabled=True,
                capabilities={"transfers": "active"},
                requirements={"currently_due": [], "disabled_reason": None},
            )
            self._save()
            event = event_body("account.updated", account)
        if self.webhook_url:
            self.deliver(event)
        return link["return_url"]

    # --- the state across restarts ---------------------------------------------------------

    def _save(self) -> None:
        """Write the state to `state_path` (under the lock): a temporary file beside it, then
        `os.replace`, so a restart mid-write finds the previous state, never half of one."""
        if self.state_path is None:
            return
        state = {
            "sessions": self.sessions,
            "accounts": self.accounts,
            "links": self.links,
            "events": self.events,
            "replays": {key: list(answer) for key, answer in self.replays.items()},
        }
        fd, temporary = tempfile.mkstemp(dir=self.state_path.parent, prefix=f".{self.state_path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(state, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.state_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _load(self) -> None:
        """Read back what `_save` wrote, if anything (a file that is not its JSON fails loudly)."""
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            state = json.loads(self.state_path.read_text())
        except ValueError as error:
            raise ValueError(
                f"{self.state_path} is not the stand-in's saved state ({error}); move it aside to start afresh"
            ) from error
        with self.lock:
            self.sessions.update(state["sessions"])
            self.accounts.update(state["accounts"])
            self.links.update(state["links"])
            self.events.update(state["events"])
            self.replays.update({key: (status, body) for key, (status, body) in state["replays"].items()})

    # --- the server --------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> LocalStripe:
        """Read the saved state back, then listen on `host:port` (0: any free port) in a background thread."""
        self._load()
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="stripe-local").start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _handler(stripe: LocalStripe) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            path = urlsplit(self.path).path
            if path.startswith("/v1/"):
                self._api("GET", path, {})
            elif (found := re.fullmatch(r"/c/pay/([\w-]+)", path)) and found.group(1) in stripe.sessions:
                self._page(200, _checkout_page(stripe.sessions[found.group(1)]))
            elif (found := re.fullmatch(r"/connect/onboarding/([\w-]+)", path)) and found.group(1) in stripe.links:
                self._page(200, _onboarding_page(stripe.links[found.group(1)]))
            else:
                self._page(404, _page("Not found", "<p>This test-mode page does not exist.</p>"))

        def do_POST(self) -> None:  # noqa: N802
            path = urlsplit(self.path).path
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            form = dict(parse_qsl(body, keep_blank_values=True))
            if path.startswith("/v1/"):
                self._api("POST", path, form)
            elif (found := re.fullmatch(r"/c/pay/([\w-]+)", path)) and found.group(1) in stripe.sessions:
                session = stripe.sessions[found.group(1)]
                if form.get("action") == "cancel":
                    self._redirect(session.get("cancel_url") or session["success_url"])
                    return
                target, failure = stripe.checkout_pay(found.group(1))
                if failure:
                    self._page(502, _checkout_page(session, failure=failure))
                else:
                    self._redirect(target)
            elif (found := re.fullmatch(r"/connect/onboarding/([\w-]+)", path)) and found.group(1) in stripe.links:
                self._redirect(stripe.onboarding_complete(found.group(1)))
            else:
                self._page(404, _page("Not found", "<p>This test-mode page does not exist.</p>"))

        def _api(self, method: str, path: str, form: dict[str, str]) -> None:
            key = self.headers.get("Idempotency-Key")
            authorization = self.headers.get("Authorization", "")
            stripe.received.append(Received(method, path, form, key, authorization))
            if not stripe.authorized(authorization):
                status, payload = _error(401, "Invalid API Key provided (this is the local test-mode Stripe).")
            else:
                status, payload = stripe.api(method, path, form, key)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Request-Id", _id("req", 14))
            self.end_headers()
            self.wfile.write(data)

        def _page(self, status: int, text: str) -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _redirect(self, location: str) -> None:
            self.send_response(303)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def _page(title: str, body: str) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)} · test mode</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1a1f36; }}
.banner {{ background: #f5a623; color: #1a1f36; padding: .5rem 1rem; font-weight: 600; text-align: center; }}
main {{ max-width: 28rem; margin: 2rem auto; background: #fff; padding: 1.5rem; border-radius: 8px; \
box-shadow: 0 1px 3px #0002; }}
.amount {{ font-size: 2rem; font-weight: 700; margin: .5rem 0 1rem; }}
button {{ font-size: 1rem; padding: .6rem 1.2rem; border-radius: 6px; border: 1px solid #635bff; cursor: pointer; }}
button.primary {{ background: #635bff; color: #fff; }} button.secondary {{ background: #fff; color: #635bff; }}
.error {{ color: #b00020; }} .muted {{ color: #697386; font-size: .9rem; }}
</style></head>
<body><div class="banner" id="test-mode">TEST MODE · local Stripe stand-in · no real money moves</div>
<main>{body}</main></body></html>"""


def _checkout_page(session: dict, *, failure: str = "") -> str:
    amount = f"{session['amount_total'] / 100:,.2f} {session['currency'].upper()}"
    error = (
        f'<p class="error" id="failure">Paid, but {html.escape(failure)}. Pay again to resend it.</p>'
        if failure
        else ""
    )
    email = (
        f'<p class="muted">for {html.escape(session["customer_email"])}</p>' if session.get("customer_email") else ""
    )
    return _page(
        "Checkout",
        f"""<h1>Checkout</h1>
<div class="amount" id="amount">{amount}</div>{email}{error}
<form method="post"><button class="primary" name="action" value="pay" type="submit">Pay</button>
<button class="secondary" name="action" value="cancel" type="submit">Cancel</button></form>
<p class="muted">Pay sends Stripe's signed <code>checkout.session.completed</code> webhook to the gateway, \
then returns there.</p>""",
    )


def _onboarding_page(link: dict) -> str:
    return _page(
        "Set up payouts",
        f"""<h1>Set up payouts</h1>
<p>Connected account <code>{html.escape(link['account'])}</code>. On Stripe the owner would enter \
their identity and bank
account here; in test mode there is nothing to enter.</p>
<form method="post"><button class="primary" type="submit">Complete onboarding</button></form>""",
    )
