"""Local test mode's Stripe stand-in, driven through the unmodified `stripe` library and the
gateway's own services: its payment page pays by sending Stripe's signed webhook, which the
gateway's verification accepts and credits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import stripe

from billing import selectors, services
from billing.errors import PaymentProviderError
from billing.models import StripeEvent, TopUp
from billing.tests.conftest import BACK, WEBHOOK_SECRET
from conftest import ROOT, free_port, make_customer, wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from billing.stripe_local import LocalStripe

pytestmark = pytest.mark.django_db


class Webhooks:
    """A stand-in for the gateway's webhook endpoint: records each delivery and answers
    with the next of `statuses` (200 once they run out)."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.deliveries: list[tuple[bytes, dict[str, str]]] = []
        self.statuses = list(statuses or [])
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.deliveries.append((body, dict(self.headers)))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/billing/stripe/webhook/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhooks(fake_stripe: LocalStripe) -> Iterator[Webhooks]:
    receiver = Webhooks()
    fake_stripe.webhook_url = receiver.url
    yield receiver
    receiver.stop()


class CheckoutPageTests:
    def test_it_pays_by_sending_stripes_signed_webhook_then_returns_to_the_success_url(
        self, catalog, fake_stripe, webhooks
    ) -> None:
        customer = make_customer(credit_ucents=0)
        topup = services.topup_create(user=customer.user, amount_cents=2_000, **BACK)
        page = httpx.get(topup.checkout_url, timeout=5)
        assert page.status_code == 200 and "TEST MODE" in page.text and "20.00 USD" in page.text
        paid = httpx.post(topup.checkout_url, data={"action": "pay"}, timeout=5)
        assert paid.status_code == 303 and paid.headers["Location"] == BACK["success_url"]
        ((body, headers),) = webhooks.deliveries
        assert headers["Content-Type"].startswith("application/json") and headers["Stripe-Signature"].startswith("t=")
        event = json.loads(body)
        assert (
            event["type"] == "checkout.session.completed" and event["data"]["object"]["id"] == topup.stripe_session_id
        )
        # the gateway's own verification and crediting, over the exact bytes delivered
        record = services.stripe_webhook_receive(payload=body, signature=headers["Stripe-Signature"])
        assert record.outcome == StripeEvent.Outcome.CREDITED
        assert selectors.customer_account(user=customer.user).balance_ucents == 2_000_000_000
        assert TopUp.objects.get(pk=topup.pk).status == TopUp.Status.PAID

    def test_its_signature_is_stripes_and_no_other_secret_verifies_it(self, catalog, fake_stripe, webhooks) -> None:
        topup = services.topup_create(user=make_customer(credit_ucents=0).user, amount_cents=500, **BACK)
        httpx.post(topup.checkout_url, data={"action": "pay"}, timeout=5)
        ((body, headers),) = webhooks.deliveries
        assert stripe.Webhook.construct_event(body.decode(), headers["Stripe-Signature"], WEBHOOK_SECRET).id
        with pytest.raises(stripe.SignatureVerificationError):
            stripe.Webhook.construct_event(body.decode(), headers["Stripe-Signature"], "whsec_someone_else")

    def test_cancel_returns_to_the_cancel_url_and_sends_nothing(self, catalog, fake_stripe, webhooks) -> None:
        topup = services.topup_create(user=make_customer(credit_ucents=0).user, amount_cents=500, **BACK)
        cancelled = httpx.post(topup.checkout_url, data={"action": "cancel"}, timeout=5)
        assert cancelled.status_code == 303 and cancelled.headers["Location"] == BACK["cancel_url"]
        assert webhooks.deliveries == [] and fake_stripe.sessions[topup.stripe_session_id]["status"] == "open"

    def test_a_refused_delivery_is_shown_and_paying_again_resends_the_same_event(
        self, catalog, fake_stripe, webhooks
    ) -> None:
        webhooks.statuses = [400]
        topup = services.topup_create(user=make_customer(credit_ucents=0).user, amount_cents=500, **BACK)
        refused = httpx.post(topup.checkout_url, data={"action": "pay"}, timeout=5)
        assert refused.status_code == 502 and "was answered 400" in refused.text
        again = httpx.post(topup.checkout_url, data={"action": "pay"}, timeout=5)
        assert again.status_code == 303
        first, second = (json.loads(body)["id"] for body, _ in webhooks.deliveries)
        assert first == second  # one event, delivered twice: the gateway records it once

    def test_it_refuses_an_api_key_that_is_not_its_own(self, catalog, fake_stripe, settings) -> None:
        settings.STRIPE_SECRET_KEY = "sk_test_someone_else"
        with pytest.raises(PaymentProviderError, match="Invalid API Key"):
            services.topup_create(user=make_customer(credit_ucents=0).user, amount_cents=500, **BACK)
        assert TopUp.objects.get().status == TopUp.Status.FAILED
        assert [call.authorization for call in fake_stripe.received] == ["Bearer sk_test_someone_else"]


class OnboardingPageTests:
    def test_completing_onboarding_sends_connects_signed_account_updated(self, catalog, fake_stripe, webhooks) -> None:
        from django.test import Client

        from billing.models import PayoutProfile
        from conftest import make_host

        host = make_host().host
        link = services.payout_account_onboard(
            host=host, return_url="http://testserver/back", refresh_url="http://testserver/again"
        )
        assert httpx.post(link, timeout=5).headers["Location"] == "http://testserver/back"
        ((body, headers),) = webhooks.deliveries
        event = json.loads(body)
        assert (
            event["type"] == "account.updated"
            and event["data"]["object"]["id"] == PayoutProfile.objects.get(host=host).stripe_account_id
        )
        # the gateway's endpoint accepts it as Stripe's and marks the account ready, no return URL needed
        answer = Client().post(
            "/billing/stripe/webhook/",
            data=body,
            content_type="application/json",
            HTTP_STRIPE_SIGNATURE=headers["Stripe-Signature"],
        )
        assert answer.status_code == 200 and answer.json()["outcome"] == "payout_ready"
        assert PayoutProfile.objects.get(host=host).status == PayoutProfile.Status.READY


class RestartTests:
    """`make run`'s supervisor restarts a stand-in that died: what the gateway and the browser
    hold (a Checkout session, an account, an onboarding link) must still be there."""

    def test_open_sessions_accounts_and_links_survive_a_restart(self, catalog, tmp_path: Path) -> None:
        from billing.stripe_local import LocalStripe

        state = tmp_path / "stripe-local.json"
        first = LocalStripe(secret_key="sk_test_local", state_path=state).start()
        client = stripe.StripeClient("sk_test_local", base_addresses={"api": first.url}, max_network_retries=0)
        try:
            session = client.v1.checkout.sessions.create(
                {
                    "mode": "payment",
                    "success_url": "http://gateway/ok",
                    "line_items": [
                        {
                            "quantity": 1,
                            "price_data": {"currency": "usd", "unit_amount": 700, "product_data": {"name": "Credit"}},
                        }
                    ],
                },
                {"idempotency_key": "topup-1"},
            )
            account = client.v1.accounts.create({"type": "express"})
            link = client.v1.account_links.create(
                {
                    "account": account.id,
                    "type": "account_onboarding",
                    "return_url": "http://gateway/back",
                    "refresh_url": "http://gateway/again",
                }
            )
        finally:
            first.stop()
        assert [path.name for path in tmp_path.iterdir()] == ["stripe-local.json"]  # (no temporary file left behind)

        second = LocalStripe(secret_key="sk_test_local", state_path=state).start(port=int(first.url.rsplit(":", 1)[1]))
        client = stripe.StripeClient("sk_test_local", base_addresses={"api": second.url}, max_network_retries=0)
        try:
            assert client.v1.checkout.sessions.retrieve(session.id).amount_total == 700
            assert httpx.get(session.url, timeout=5).status_code == 200  # the Checkout page the browser was sent to
            again = client.v1.checkout.sessions.create(
                {
                    "mode": "payment",
                    "success_url": "http://gateway/ok",
                    "line_items": [
                        {
                            "quantity": 1,
                            "price_data": {"currency": "usd", "unit_amount": 700, "product_data": {"name": "Credit"}},
                        }
                    ],
                },
                {"idempotency_key": "topup-1"},
            )
            assert again.id == session.id  # the idempotency replay survived too
            assert httpx.post(link.url, timeout=5).headers["Location"] == "http://gateway/back"
            assert client.v1.accounts.retrieve(account.id).payouts_enabled is True
        finally:
            second.stop()
        third = LocalStripe(state_path=state).start()
        third.stop()
        assert third.accounts[account.id]["payouts_enabled"] is True  # onboarding, done after the restart, was saved

    def test_a_failed_write_leaves_the_previous_state_whole(self, tmp_path: Path, monkeypatch) -> None:
        from billing.stripe_local import LocalStripe

        state = tmp_path / "stripe-local.json"
        stand_in = LocalStripe(state_path=state)
        stand_in.api("POST", "/v1/accounts", {"type": "express"}, None)
        before = state.read_text()

        def crash(*_: object) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(os, "replace", crash)
        with pytest.raises(OSError, match="disk full"):
            stand_in.api("POST", "/v1/accounts", {"type": "express"}, None)
        assert state.read_text() == before and len(json.loads(before)["accounts"]) == 1
        assert [path.name for path in tmp_path.iterdir()] == ["stripe-local.json"]


class CommandTests:
    @pytest.mark.e2e
    def test_the_command_serves_stripes_api_to_its_key_only(self, tmp_path: Path) -> None:
        port = free_port()
        env = {**os.environ, "STRIPE_SECRET_KEY": "sk_test_local_cmd", "STRIPE_WEBHOOK_SECRET": "whsec_local_cmd"}
        proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "stripe_local",
                "--port",
                str(port),
                "--webhook-url",
                "http://127.0.0.1:9/billing/stripe/webhook/",
                "--state",
                str(tmp_path / "state.json"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"

            def up() -> bool:
                try:
                    return httpx.get(f"{base}/v1/accounts/acct_none", timeout=1).status_code == 401
                except httpx.HTTPError:
                    return False

            wait_until(up, timeout=60, what="stripe_local to listen")
            client = stripe.StripeClient("sk_test_local_cmd", base_addresses={"api": base})
            account = client.v1.accounts.create({"type": "express"})
            assert account.id.startswith("acct_") and client.v1.accounts.retrieve(account.id).details_submitted is False
            with pytest.raises(stripe.AuthenticationError):
                stripe.StripeClient("sk_test_wrong", base_addresses={"api": base}).v1.accounts.retrieve(account.id)
        finally:
            proc.terminate()
            output = proc.communicate(timeout=20)[0]
        assert proc.returncode == 0 and f"Stripe test mode: a local stand-in at {base}" in output

    def test_the_command_refuses_to_start_without_test_keys(self, settings) -> None:
        from django.core.management import CommandError, call_command

        settings.STRIPE_SECRET_KEY = "sk_live_real"
        with pytest.raises(CommandError, match="sk_test_"):
            call_command("stripe_local", "--port", "0", "--webhook-url", "http://127.0.0.1:9/")
