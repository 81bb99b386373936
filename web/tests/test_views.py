from __future__ import annotations

import re

import pytest
from django.core import mail
from django.test import Client
from django.utils import timezone

from accounts.models import ApiKey
from billing.models import Payout, PayoutProfile, TopUp
from catalog.models import CatalogModel
from conftest import make_customer, make_host
from core.secrets import secret_hash
from hosts.models import Host
from marketplace.models import Request
from web.tests.conftest import signed_in
from web.tests.factories import canary_checked, finished_request

pytestmark = pytest.mark.django_db

CUSTOMER_PAGES = [
    "/",
    "/keys/",
    "/usage/",
    "/usage/csv/",
    "/models/",
    "/quickstart/",
    "/machines/",
    "/machines/status.json",
]


class AnonymousTests:
    @pytest.mark.parametrize("path", [*CUSTOMER_PAGES, "/machines/1/", "/pool/"])
    def test_it_sends_anonymous_visitors_to_the_login_page(self, catalog, path: str) -> None:
        response = Client().get(path)
        assert response.status_code == 302
        assert response["Location"] == f"/login/?next={path}"

    @pytest.mark.parametrize("path", ["/login/", "/signup/", "/password-reset/"])
    def test_it_shows_the_account_pages_to_anyone(self, db, path: str) -> None:
        assert Client().get(path).status_code == 200

    def test_it_refuses_posts_without_a_session(self, catalog) -> None:
        response = Client().post("/keys/", {"name": "x"})
        assert response.status_code == 302 and ApiKey.objects.count() == 0


class CustomerPagesTests:
    @pytest.mark.parametrize("path", CUSTOMER_PAGES)
    def test_it_shows_every_page_to_the_signed_in_customer(self, customer_client, path: str) -> None:
        assert customer_client.get(path).status_code == 200

    def test_the_dashboard_shows_balance_and_money_on_hold(self, customer, customer_client) -> None:
        from billing import services as billing

        billing.hold_place(user=customer.user, api_key=customer.key, amount_ucents=25_000_000)
        page = customer_client.get("/").content.decode()
        assert "$5.00" in page  # the persona's balance
        assert "$0.25" in page and "$4.75" in page  # on hold, available

    def test_the_dashboard_links_to_the_top_up_history_on_the_usage_page(self, customer_client) -> None:
        page = customer_client.get("/").content.decode()
        assert re.search(r'<a href="/usage/#topups">Top-up history</a>', page)
        assert 'id="topups"' in customer_client.get("/usage/").content.decode()

    def test_the_catalog_lists_prices_per_million_tokens_and_context(self, customer_client) -> None:
        page = customer_client.get("/models/").content.decode()
        assert "gemma-3-270m" in page and "4096 tokens" in page
        assert "$0.10" in page and "$0.40" in page

    def test_the_quickstart_uses_the_base_url_the_visitor_reached(self, customer_client) -> None:
        page = customer_client.get("/quickstart/", HTTP_HOST="localhost").content.decode()
        assert 'base_url="http://localhost/v1"' in page
        assert "from openai import OpenAI" in page


class SignupTests:
    def test_it_creates_an_unconfirmed_user_and_the_emailed_link_confirms_and_signs_in(self, catalog) -> None:
        client = Client()
        response = client.post("/signup/", {"email": "New@Example.com", "password": "correct horse battery"})
        assert response.status_code == 200 and "Check your e-mail" in response.content.decode()
        from django.contrib.auth import get_user_model

        from web.services import email_unverified

        user = get_user_model().objects.get(username="new@example.com")
        assert (
            user.email == "new@example.com" and user.check_password("correct horse battery") and email_unverified(user)
        )
        assert client.get("/keys/").status_code == 302, "not signed in until the address is confirmed"
        (message,) = mail.outbox
        link = re.search(r"http://testserver(/verify/\S+/)", message.body).group(1)
        assert "new@example.com" in client.get(link).content.decode() and email_unverified(
            user
        )  # a GET asks, changes nothing
        assert client.post(link, {"password": "correct horse battery"}).status_code == 302 and not email_unverified(
            user
        )
        assert client.get("/keys/").status_code == 200
        assert Client().get(link.replace("/verify/", "/verify/x")).status_code == 400

    def test_signing_up_with_a_taken_address_answers_the_same_and_tells_its_owner(self, customer) -> None:
        taken = Client().post("/signup/", {"email": customer.user.username, "password": "correct horse battery"})
        fresh = Client().post("/signup/", {"email": "fresh@example.com", "password": "correct horse battery"})
        strip = lambda page, email: page.content.decode().replace(email, "EMAIL")  # noqa: E731
        assert taken.status_code == fresh.status_code == 200
        assert strip(taken, customer.user.username) == strip(fresh, "fresh@example.com"), (
            "the page says nothing about the account"
        )
        to_owner = [m for m in mail.outbox if m.to == [customer.user.username]]
        assert len(to_owner) == 1 and "tried to create an account" in to_owner[0].body
        customer.user.refresh_from_db()
        assert not customer.user.check_password("correct horse battery"), (
            "a sign-up of a confirmed address changes nothing"
        )

    def test_a_signed_in_unconfirmed_user_can_have_the_link_sent_again_three_times_an_hour(self, db) -> None:
        Client().post("/signup/", {"email": "c@example.com", "password": "correct horse battery"})
        client = Client()
        client.post("/login/", {"username": "c@example.com", "password": "correct horse battery"})
        keys = client.get("/keys/").content.decode()
        assert 'action="/verify/resend/"' in keys
        for _ in range(3):
            assert client.post("/verify/resend/", follow=True).content.decode().count("A new confirmation link") == 1
        refused = client.post("/verify/resend/", follow=True).content.decode()
        assert "Three links were sent" in refused
        links = [m for m in mail.outbox if m.to == ["c@example.com"]]
        assert len(links) == 4  # the sign-up's and three again
        fresh = re.search(r"http://testserver(/verify/\S+/)", links[-1].body).group(1)
        stale = re.search(r"http://testserver(/verify/\S+/)", links[-2].body).group(1)
        assert client.post(stale, {"password": "correct horse battery"}).status_code == 400, (
            "only the latest link works"
        )
        assert client.post(fresh, {"password": "correct horse battery"}).status_code == 302
        assert "Send the link again" not in client.get("/keys/").content.decode()
        assert client.post("/verify/resend/", follow=True).content.decode().count("A new confirmation link") == 0

    @pytest.mark.parametrize(
        ("password", "said"),
        [
            ("short", "too short"),
            ("password123", "too common"),
            ("83920174650", "entirely numeric"),
            ("alice.liddell", "too similar to the"),
        ],
    )
    def test_it_refuses_a_weak_password_with_djangos_validators(self, db, password, said) -> None:
        response = Client().post("/signup/", {"email": "alice.liddell@example.com", "password": password})
        assert response.status_code == 200 and said in response.content.decode()

    def test_a_user_logs_in_with_email_and_password_and_out_again(self, db) -> None:  # (before confirming: pages only)
        Client().post("/signup/", {"email": "b@example.com", "password": "correct horse battery"})
        client = Client()
        response = client.post("/login/", {"username": "B@example.com", "password": "correct horse battery"})
        assert response.status_code == 302 and response["Location"] == "/"
        assert client.post("/logout/").status_code == 302
        assert client.get("/").status_code == 302

    def test_the_password_reset_link_lets_the_user_choose_a_new_password(self, db) -> None:
        Client().post("/signup/", {"email": "c@example.com", "password": "correct horse battery"})
        client = Client()
        assert client.post("/password-reset/", {"email": "c@example.com"}).status_code == 302
        (message,) = [m for m in mail.outbox if "password-reset" in m.body]
        link = re.search(r"http://testserver(/password-reset/\S+/)", message.body).group(1)
        form = client.get(link, follow=True)
        assert form.status_code == 200
        from django.contrib.auth import get_user_model

        from accounts.models import ApiKey, EmailVerification
        from accounts.services import api_key_create

        user = get_user_model().objects.get(username="c@example.com")
        EmailVerification.objects.filter(user=user).update(verified_at=timezone.now())  # (no key before confirming)
        planted = api_key_create(user=user, name="made by someone else")
        assert "Also revoke every API key" in form.content.decode()
        new = {"new_password1": "another long secret", "new_password2": "another long secret", "revoke_keys": "on"}
        done = client.post(form.redirect_chain[-1][0], new)
        assert done.status_code == 302
        assert ApiKey.objects.get(pk=planted.key.pk).revoked_at is not None, "the reset asked, and the keys went"
        signed_in = Client().post("/login/", {"username": "c@example.com", "password": "another long secret"})
        assert signed_in.status_code == 302 and signed_in["Location"] == "/"


class ApiKeyPagesTests:
    def test_it_shows_a_new_secret_once_and_stores_only_its_hash(self, customer, customer_client) -> None:
        response = customer_client.post("/keys/", {"name": "laptop", "cap_usd": "2.5"})
        assert response.status_code == 200 and response["Cache-Control"] == "no-store"
        secret = re.search(r'id="new-secret">([^<]+)<', response.content.decode()).group(1)
        key = ApiKey.objects.get(user=customer.user, name="laptop")
        assert key.key_hash == secret_hash(secret) and key.prefix == secret[:12]
        assert key.spend_cap_ucents == 250_000_000
        assert secret not in {key.name, key.prefix, key.key_hash}
        listing = customer_client.get("/keys/").content.decode()
        assert secret not in listing and key.prefix in listing and "$2.50" in listing

    def test_a_key_created_here_works_on_the_api(self, customer, customer_client) -> None:
        response = customer_client.post("/keys/", {"name": "api"})
        secret = re.search(r'id="new-secret">([^<]+)<', response.content.decode()).group(1)
        assert Client().get("/v1/usage", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 200

    def test_a_key_can_ask_for_trusted_hosts_only(self, customer, customer_client) -> None:
        customer_client.post("/keys/", {"name": "careful", "trusted_only": "on"})
        customer_client.post("/keys/", {"name": "any"})
        assert ApiKey.objects.get(user=customer.user, name="careful").trusted_only
        assert not ApiKey.objects.get(user=customer.user, name="any").trusted_only
        assert "trusted only" in customer_client.get("/keys/").content.decode()

    def test_the_owner_revokes_a_key(self, customer, customer_client) -> None:
        response = customer_client.post(f"/keys/{customer.key.pk}/revoke/")
        assert response.status_code == 302
        customer.key.refresh_from_db()
        assert customer.key.revoked_at is not None

    def test_an_outsider_can_neither_see_nor_revoke_a_key(self, customer, outsider_client) -> None:
        assert customer.key.prefix not in outsider_client.get("/keys/").content.decode()
        assert outsider_client.post(f"/keys/{customer.key.pk}/revoke/").status_code == 404
        customer.key.refresh_from_db()
        assert customer.key.revoked_at is None

    def test_it_refuses_a_post_without_a_csrf_token(self, customer) -> None:
        client = Client(enforce_csrf_checks=True)
        client.force_login(customer.user)
        assert client.post("/keys/", {"name": "forged"}).status_code == 403
        assert client.post(f"/keys/{customer.key.pk}/revoke/").status_code == 403
        assert not ApiKey.objects.filter(name="forged").exists()
        token = client.get("/keys/").cookies["csrftoken"].value
        assert client.post("/keys/", {"name": "real", "csrfmiddlewaretoken": token}).status_code == 200


class TopupPageTests:
    def test_it_says_top_ups_are_not_configured(self, customer_client, no_stripe) -> None:
        assert "Top-ups are not configured" in customer_client.get("/").content.decode()
        response = customer_client.post("/topup/", {"amount_usd": "20"}, follow=True)
        assert "not configured" in response.content.decode() and TopUp.objects.count() == 0

    def test_it_redirects_to_stripe_checkout(self, customer, customer_client, fake_stripe) -> None:
        response = customer_client.post("/topup/", {"amount_usd": "20"})
        topup = TopUp.objects.get(user=customer.user)
        assert topup.amount_cents == 2_000
        assert response.status_code == 302 and response["Location"] == topup.checkout_url
        assert (
            response["Location"] == f"{fake_stripe.url}/c/pay/{topup.stripe_session_id}"
        )  # local test mode's payment page

    def test_it_explains_an_amount_out_of_range(self, customer_client, fake_stripe) -> None:
        response = customer_client.post("/topup/", {"amount_usd": "1"}, follow=True)
        assert "Top-ups are between $5.00 and $500.00." in response.content.decode() and TopUp.objects.count() == 0


class UsagePageTests:
    def test_it_lists_the_customers_requests_with_status_resumed_and_cost(
        self, customer, customer_client, serving_host
    ) -> None:
        mine = finished_request(customer=customer, host=serving_host.host, cost_ucents=123_456, resumed=True)
        failed = finished_request(customer=customer, failed=True)
        theirs = finished_request(customer=make_customer(), cost_ucents=999)
        page = customer_client.get("/usage/").content.decode()
        assert mine.public_id in page and failed.public_id in page and theirs.public_id not in page
        assert "resumed" in page and "$0.00123456" in page and "failed" in page
        assert page.count("<rect ") == 3 * 30  # three charts, a bar per day

    @pytest.mark.django_db(transaction=True)  # the CSV is read by the async server's database threads
    def test_the_csv_holds_only_the_customers_requests(self, customer, customer_client) -> None:
        mine = finished_request(customer=customer, cost_ucents=500)
        theirs = finished_request(customer=make_customer(), cost_ucents=500)
        response = customer_client.get("/usage/csv/")
        body = b"".join(response).decode()
        assert response["Content-Type"].startswith("text/csv")
        assert body.splitlines()[0].startswith("id,created,model")
        assert mine.public_id in body and theirs.public_id not in body

    def test_a_malformed_range_falls_back_to_the_last_30_days(self, customer_client) -> None:
        response = customer_client.get("/usage/?from=yesterday&to=2020-13-01")
        assert response.status_code == 200 and response.content.decode().count("<rect ") == 90


class QuickstartPageTests:
    def test_the_quickstart_chat_snippet_names_a_chat_model_and_the_embeddings_one_an_embeddings_model(
        self, customer
    ) -> None:
        from web.tests.test_quickstart_e2e import snippet

        page = signed_in(customer.user).get("/quickstart/").content.decode()
        assert 'model="gemma-3-270m"' in snippet(page, "chat")  # not the first model by name, an embeddings model
        assert 'model="all-minilm-l6-v2"' in snippet(page, "embeddings")

    def test_the_quickstart_prefers_the_chat_model_that_hosts_serve_now(self, customer) -> None:
        from catalog.models import CatalogModel
        from testkit.personas import present
        from web.tests.test_quickstart_e2e import snippet

        CatalogModel.objects.create(
            name="aaa-chat", kind="chat", context_length=2048, input_price_ucents=1, output_price_ucents=1
        )  # first by name, served by nobody
        present(make_host())  # serves gemma-3-270m
        page = signed_in(customer.user).get("/quickstart/").content.decode()
        assert 'model="gemma-3-270m"' in snippet(page, "chat")


class ReadableMoneyTests:
    """Usage split by model and by key, top-ups listed, charts with values on their axes."""

    def test_the_usage_page_splits_tokens_and_cost_by_model_and_by_key(self, customer, customer_client) -> None:
        from accounts.services import api_key_create
        from catalog.models import CatalogModel

        finished_request(customer=customer, cost_ucents=1_000)
        finished_request(customer=customer, cost_ucents=2_000)
        customer.key = api_key_create(user=customer.user, name="server").key
        embedded = finished_request(customer=customer, cost_ucents=40)
        Request.objects.filter(pk=embedded.pk).update(model=CatalogModel.objects.get(name="all-minilm-l6-v2"))
        finished_request(customer=make_customer(), cost_ucents=777_777)  # someone else's
        page = customer_client.get("/usage/").content.decode()
        by_model = page[page.index('id="by-model"') : page.index('id="by-key"')]
        by_key = page[page.index('id="by-key"') : page.index('id="recent"')]
        assert re.search(
            r"gemma-3-270m</code></td>\s*<td class=\"num\">2</td><td class=\"num\">14</td><td class=\"num\">10</td>"
            r"<td class=\"num\">\$0.00003</td>",
            by_model,
        )
        assert re.search(r"all-minilm-l6-v2</code></td>\s*<td class=\"num\">1</td>.*\$0.0000004<", by_model)
        assert "server" in by_key and "$0.0000004" in by_key and "$0.00003<" in by_key and "$0.00777777" not in page

    def test_the_usage_page_lists_the_customers_top_ups(self, customer, customer_client) -> None:
        from billing.services import credit_grant

        paid = credit_grant(user=customer.user, amount_ucents=2_500_000_000, reference="topup-test")
        TopUp.objects.create(
            user=customer.user,
            amount_cents=2_500,
            status="paid",
            transaction=paid,
            refunded_cents=500,
            paid_at=timezone.now(),
            stripe_session_id="cs_1",
        )
        TopUp.objects.create(user=make_customer().user, amount_cents=9_900, status="open", stripe_session_id="cs_2")
        topups = customer_client.get("/usage/").content.decode().split('id="topups"')[1]
        assert "$25.00" in topups and "$5.00" in topups and "paid" in topups and "$99.00" not in topups

    def test_charts_label_their_value_axis(self, customer, customer_client) -> None:
        finished_request(customer=customer, cost_ucents=250_000_000)  # $2.50 today
        page = customer_client.get("/usage/").content.decode()
        assert re.findall(r'<text class="y"[^>]*>([^<]+)</text>', page)[-5:] == [
            "$0.00",
            "$1.00",
            "$2.00",
            "$3.00",
            "$4.00",
        ]
        assert len(re.findall(r'<text class="x"', page)) >= 3 * 3


class FormRuleTests:
    """A refused form says what the rule is, not only that the input was wrong."""

    @pytest.mark.parametrize("cap", ["abc", "-1", "0.000000001", "123456"])
    def test_a_bad_spend_cap_is_answered_with_the_rule(self, customer_client, cap: str) -> None:
        page = customer_client.post("/keys/", {"name": "x", "cap_usd": cap}).content.decode()
        assert "A spend cap is an amount in US dollars from $0 to $9,999.99999999" in page
        assert ApiKey.objects.filter(name="x").count() == 0

    def test_a_machine_without_a_name_is_answered_with_the_rule(self, customer_client) -> None:
        page = customer_client.post("/machines/", {"name": ""}).content.decode()
        assert "Give the machine a name (up to 100 characters)" in page

    def test_a_malformed_date_is_named_with_its_format(self, customer_client) -> None:
        page = customer_client.get("/usage/?from=yesterday").content.decode()
        assert "Enter a date as YYYY-MM-DD." in page


class HostPagesTests:
    def test_becoming_a_host_shows_the_token_once_with_the_mahout_command(self, customer, customer_client) -> None:
        response = customer_client.post("/machines/", {"name": "desk"}, HTTP_HOST="localhost")
        page = response.content.decode()
        host = Host.objects.get(name="desk")
        assert host.owner == customer.user
        token = re.search(r'id="host-token" class="wrap"><code>(\S+)</code>', page).group(1)
        assert host.token_hash == secret_hash(token)
        assert "mahout login --server http://localhost\nmahout run" in page
        assert f"--token {token}" not in page, "the token stays off the command line (ps, shell history)"
        assert token not in customer_client.get("/machines/").content.decode()

    def test_the_page_offers_the_wheel_once_the_operator_built_it(self, customer_client, settings, tmp_path) -> None:
        from web.views import MAHOUT_WHEEL

        settings.BASE_DIR = tmp_path
        page = customer_client.post("/machines/", {"name": "desk"}, HTTP_HOST="localhost").content.decode()
        assert "make mahout-wheel" in page and "pip install" not in page
        assert Client().get(f"/downloads/{MAHOUT_WHEEL}").status_code == 404
        (tmp_path / "dist").mkdir()
        (tmp_path / "dist" / MAHOUT_WHEEL).write_bytes(b"PK wheel bytes")
        page = customer_client.post("/machines/", {"name": "desk2"}, HTTP_HOST="localhost").content.decode()
        assert f"pip install http://localhost/downloads/{MAHOUT_WHEEL}\nmahout login" in page
        download = Client().get(f"/downloads/{MAHOUT_WHEEL}")
        assert download.status_code == 200 and b"".join(download.streaming_content) == b"PK wheel bytes"
        assert Client().get("/downloads/..%2Fsettings.py").status_code == 404
        assert Client().get("/downloads/other.whl").status_code == 404

    def test_a_second_machine_with_the_same_name_is_refused_politely(self, serving_host, host_client) -> None:
        response = host_client.post("/machines/", {"name": serving_host.host.name})
        assert response.status_code == 200 and "already have a machine" in response.content.decode()

    def test_the_status_endpoint_lists_only_the_owners_machines(self, serving_host, outsider, host_client) -> None:
        hosts = host_client.get("/machines/status.json").json()["hosts"]
        assert [(h["id"], h["status"]) for h in hosts] == [(serving_host.host.pk, "offline")]

    def test_the_machines_page_shows_jobs_running_of_the_slots_a_machine_takes(
        self, customer, serving_host, host_client
    ) -> None:
        from testkit.requests import submit_request

        Host.objects.filter(pk=serving_host.host.pk).update(slots=4)
        for _ in range(2):
            request = submit_request(customer, CatalogModel.objects.get(name="gemma-3-270m"))
            request.jobs.update(status="running", host=serving_host.host)
        hosts = host_client.get("/machines/status.json").json()["hosts"]
        assert [(h["id"], h["jobs"]) for h in hosts] == [(serving_host.host.pk, "2 of 4")]
        assert "2 of 4" in host_client.get("/machines/").content.decode()

    def test_the_owner_sees_benchmarks_earnings_and_the_statement(self, customer, serving_host, host_client) -> None:
        finished_request(customer=customer, host=serving_host.host, cost_ucents=1_000_000)
        page = host_client.get(f"/machines/{serving_host.host.pk}/").content.decode()
        assert "40.0" in page and "500.0" in page and "50 ms" in page  # the qualification's figures
        assert "$0.008" in page  # 80% of one cent, in the statement and the balance
        assert "Earnings per day" in page

    def test_an_outsider_gets_404_for_someone_elses_machine(self, serving_host, outsider_client) -> None:
        assert outsider_client.get(f"/machines/{serving_host.host.pk}/").status_code == 404
        assert outsider_client.post(f"/machines/{serving_host.host.pk}/payout/").status_code == 404
        assert serving_host.host.name not in outsider_client.get("/machines/").content.decode().replace("outsider", "")

    def test_a_payout_without_a_payout_account_is_explained(self, serving_host, host_client) -> None:
        response = host_client.post(f"/machines/{serving_host.host.pk}/payout/", {}, follow=True)
        assert "no payout account" in response.content.decode() and Payout.objects.count() == 0

    def test_a_banned_machines_owner_cannot_request_a_payout(
        self, customer, serving_host, host_client, settings
    ) -> None:
        from hosts.services import host_ban

        settings.PAYOUT_MINIMUM_UCENTS, settings.EARNINGS_VEST_SECONDS = 1_000_000, 0
        PayoutProfile.objects.create(host=serving_host.host, stripe_account_id="acct_test")
        finished_request(customer=customer, host=serving_host.host, cost_ucents=10_000_000)
        host_ban(host=serving_host.host, reason="served made-up text", by="operator")
        response = host_client.post(f"/machines/{serving_host.host.pk}/payout/", {"amount_usd": "0.05"}, follow=True)
        assert "This machine is banned, so it cannot request payouts" in response.content.decode()
        assert Payout.objects.count() == 0

    def test_the_owner_requests_a_payout_and_sees_its_state(
        self, customer, serving_host, host_client, settings
    ) -> None:
        settings.PAYOUT_MINIMUM_UCENTS = 1_000_000
        PayoutProfile.objects.create(host=serving_host.host, stripe_account_id="acct_test")
        finished_request(customer=customer, host=serving_host.host, cost_ucents=10_000_000)  # host earns 8 cents
        page = host_client.get(f"/machines/{serving_host.host.pk}/").content.decode()
        assert "Not yet payable" in page and "$0.08" in page, "earnings vest before they are payable"
        settings.EARNINGS_VEST_SECONDS = 0
        response = host_client.post(f"/machines/{serving_host.host.pk}/payout/", {"amount_usd": "0.05"}, follow=True)
        (payout,) = Payout.objects.filter(host=serving_host.host)
        assert payout.amount_ucents == 5_000_000 and payout.status == Payout.Status.REQUESTED
        page = response.content.decode()
        assert "Payout of $0.05 requested" in page and "requested" in page


class MachineMaintenanceTests:
    def test_the_machines_page_shows_the_badge_the_reason_and_a_resume_form(self, serving_host, host_client) -> None:
        from hosts.services import host_maintenance_enter

        host = serving_host.host
        Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now())
        host_maintenance_enter(host=host, reason="Your GPU reports ECC errors", by="automatic")
        page = host_client.get("/machines/").content.decode()
        assert '<span class="badge maintenance" data-status>maintenance</span>' in page
        assert "Your GPU reports ECC errors" in page
        assert f'action="/machines/{host.pk}/resume/"' in page and "csrfmiddlewaretoken" in page
        (row,) = host_client.get("/machines/status.json").json()["hosts"]
        assert (row["status"], row["maintenance_reason"]) == ("maintenance", "Your GPU reports ECC errors")
        detail = host_client.get(f"/machines/{host.pk}/").content.decode()
        assert "In maintenance" in detail and "Your GPU reports ECC errors" in detail and ">Resume</button>" in detail

    def test_out_of_maintenance_the_resume_form_is_hidden(self, serving_host, host_client) -> None:
        page = host_client.get("/machines/").content.decode()
        assert "data-maintenance hidden" in page
        assert "In maintenance" not in host_client.get(f"/machines/{serving_host.host.pk}/").content.decode()

    def test_the_owner_resumes_from_the_machines_page(self, serving_host, host_client) -> None:
        from hosts.services import host_maintenance_enter

        host = serving_host.host
        host_maintenance_enter(host=host, reason="disk full", by="automatic")
        response = host_client.post(f"/machines/{host.pk}/resume/", {"next": "machines"}, follow=True)
        assert response.redirect_chain[-1][0] == "/machines/"
        assert "out of maintenance" in response.content.decode()
        assert Host.objects.get(pk=host.pk).maintenance_since is None
        again = host_client.post(f"/machines/{host.pk}/resume/", follow=True)
        assert (
            again.redirect_chain[-1][0] == f"/machines/{host.pk}/"
            and "was not in maintenance" in again.content.decode()
        )

    def test_resume_needs_a_post_with_the_csrf_token(self, serving_host) -> None:
        from hosts.services import host_maintenance_enter

        host_maintenance_enter(host=serving_host.host, reason="disk full", by="operator")
        client = Client(enforce_csrf_checks=True)
        client.force_login(serving_host.host.owner)
        assert client.get(f"/machines/{serving_host.host.pk}/resume/").status_code == 405
        assert client.post(f"/machines/{serving_host.host.pk}/resume/").status_code == 403
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_since is not None

    def test_an_outsider_gets_404_on_the_resume_url(self, serving_host, outsider_client) -> None:
        from hosts.services import host_maintenance_enter

        host_maintenance_enter(host=serving_host.host, reason="disk full", by="operator")
        assert outsider_client.post(f"/machines/{serving_host.host.pk}/resume/").status_code == 404
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_since is not None


class MachineHeldMaintenanceTests:
    @pytest.mark.parametrize(("by", "shown"), [("operator", "the operator"), ("verification", "verification")])
    def test_the_page_says_who_set_it_and_offers_no_resume(
        self, serving_host, host_client, by: str, shown: str
    ) -> None:
        from hosts.services import host_maintenance_enter

        host = serving_host.host
        host_maintenance_enter(host=host, reason="Replace the fan", by=by)
        page = host_client.get("/machines/").content.decode()
        assert f"Set by <span data-by>{shown}" in page and "Replace the fan" in page
        assert f'action="/machines/{host.pk}/resume/" class="inline" data-resume hidden' in page
        (row,) = host_client.get("/machines/status.json").json()["hosts"]
        assert (row["may_resume"], row["maintenance_by"].startswith(shown)) == (False, True)
        detail = host_client.get(f"/machines/{host.pk}/").content.decode()
        assert "Only an operator can lift this maintenance" in detail and ">Resume</button>" not in detail

    @pytest.mark.parametrize("by", ["operator", "verification"])
    def test_a_resume_post_is_refused_and_changes_nothing(self, serving_host, host_client, by: str) -> None:
        from hosts.services import host_maintenance_enter

        host_maintenance_enter(host=serving_host.host, reason="Replace the fan", by=by)
        response = host_client.post(f"/machines/{serving_host.host.pk}/resume/", follow=True)
        assert "Only an operator can lift this maintenance" in response.content.decode()
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_by == by

    def test_the_reliability_rule_is_the_owners_to_lift(self, serving_host, host_client) -> None:
        from hosts.services import host_maintenance_enter

        host_maintenance_enter(host=serving_host.host, reason="12 jobs failed", by="automatic")
        page = host_client.get("/machines/").content.decode()
        assert "Set by <span data-by>the reliability rule" in page and "data-resume>" in page


class MachineBanTests:
    def test_the_owner_sees_the_reason_and_no_resume_or_rotate(self, serving_host, host_client) -> None:
        from hosts.services import host_ban, host_maintenance_enter

        host = serving_host.host
        host_maintenance_enter(host=host, reason="12 jobs failed", by="automatic")
        host_ban(host=host, reason="Canary answers did not match the model", by="ops")
        page = host_client.get("/machines/").content.decode()
        assert '<span class="badge banned" data-status>banned</span>' in page
        assert "Banned by the operator: <span data-ban-reason>Canary answers did not match the model</span>" in page
        assert f'action="/machines/{host.pk}/token/" class="inline" data-rotate hidden' in page
        assert "data-maintenance hidden" in page  # the ban is what the owner reads
        (row,) = host_client.get("/machines/status.json").json()["hosts"]
        assert (row["status"], row["ban_reason"], row["may_resume"]) == (
            "banned",
            "Canary answers did not match the model",
            False,
        )
        detail = host_client.get(f"/machines/{host.pk}/").content.decode()
        assert (
            "Banned by the operator: <strong data-ban-reason>Canary answers did not match the model</strong>" in detail
        )
        assert ">Resume</button>" not in detail and ">New token</button>" not in detail

    def test_the_owner_cannot_lift_it_by_posting(self, serving_host, host_client) -> None:
        from hosts.services import host_ban, host_maintenance_enter

        host = serving_host.host
        host_maintenance_enter(host=host, reason="12 jobs failed", by="automatic")
        host_ban(host=host, reason="fraud", by="ops")
        resumed = host_client.post(f"/machines/{host.pk}/resume/", follow=True).content.decode()
        rotated = host_client.post(f"/machines/{host.pk}/token/", follow=True).content.decode()
        assert "banned by the operator: fraud" in resumed and "banned by the operator: fraud" in rotated
        row = Host.objects.get(pk=host.pk)
        assert row.banned_at is not None and row.maintenance_since is not None
        assert Host.objects.filter(token_hash=row.token_hash).count() == 1 and "has a new token" not in rotated


class MachineTokenRotationTests:
    def test_a_new_token_is_shown_once_and_the_old_one_stops_working(self, serving_host, host_client) -> None:
        import json

        def heartbeat(token: str) -> int:
            return (
                Client()
                .post(
                    "/hosts/api/heartbeat",
                    data=json.dumps({"fingerprint": serving_host.fingerprint}),
                    content_type="application/json",
                    HTTP_AUTHORIZATION=f"Bearer {token}",
                )
                .status_code
            )

        assert heartbeat(serving_host.token) == 200
        response = host_client.post(f"/machines/{serving_host.host.pk}/token/")
        page = response.content.decode()
        assert response.status_code == 200 and response["Cache-Control"] == "no-store"
        assert f"“{serving_host.host.name}” has a new token" in page
        token = re.search(r'id="host-token" class="wrap"><code>(host-[\w-]+)</code>', page).group(1)
        assert (heartbeat(serving_host.token), heartbeat(token)) == (401, 200)
        again = host_client.get("/machines/").content.decode()
        assert token not in again and token[:12] not in page.split("has a new token")[0]

    def test_it_needs_a_post_with_the_csrf_token(self, serving_host) -> None:
        client = Client(enforce_csrf_checks=True)
        client.force_login(serving_host.host.owner)
        assert client.get(f"/machines/{serving_host.host.pk}/token/").status_code == 405
        assert client.post(f"/machines/{serving_host.host.pk}/token/").status_code == 403
        assert Host.objects.get(pk=serving_host.host.pk).token_hash == secret_hash(serving_host.token)

    def test_an_outsider_gets_404(self, serving_host, outsider_client) -> None:
        assert outsider_client.post(f"/machines/{serving_host.host.pk}/token/").status_code == 404
        assert Host.objects.get(pk=serving_host.host.pk).token_hash == secret_hash(serving_host.token)


class PoolPageTests:
    def test_staff_see_the_pool(self, customer, serving_host, staff_client) -> None:
        from hosts.services import host_maintenance_enter

        finished_request(customer=customer, failed=True)
        host_maintenance_enter(host=serving_host.host, reason="thermal throttling", by="operator")
        page = staff_client.get("/pool/").content.decode()
        assert "Pool overview" in page and "Failed attempts, last hour" in page
        assert "Jobs streaming" in page and "Warm hosts" in page and "gemma-3-270m" in page
        assert "Hosts in maintenance" in page and "thermal throttling" in page

    def test_it_shows_trust_counts_canary_pass_rate_bans_and_failed_verification(self, catalog, staff_client) -> None:
        from hosts.services import host_ban

        trusted, probation, banned, cheat = (
            make_host(name=name).host for name in ("trusted", "probation", "banned", "cheat")
        )
        Host.objects.filter(pk=trusted.pk).update(trusted_at=timezone.now())
        host_ban(host=banned, reason="Sold stolen GPU time", by="ops")
        for host, verdict in [(trusted, "passed"), (trusted, "passed"), (trusted, "passed"), (cheat, "failed")]:
            canary_checked(host=host, verdict=verdict, reason="the answer differs from the real model's at character 3")
        page = staff_client.get("/pool/").content.decode()
        assert "<span class=\"value\">1 trusted</span>" in page
        assert (
            "<span data-probation>2</span> in probation · <span data-banned>1</span> banned" in page
        )  # probation, cheat
        assert '<span class="value">75.0%</span>' in page and "3 passed · 1 failed" in page
        failed = page.split('id="pool-failed-verification"')[1].split("</table>")[0]
        assert "cheat" in failed and "at character 3" in failed and "trusted<" not in failed
        bans = page.split('id="pool-banned"')[1].split("</table>")[0]
        assert "Sold stolen GPU time" in bans and "<td>ops</td>" in bans

    def test_it_is_forbidden_to_customers(self, customer_client) -> None:
        assert customer_client.get("/pool/").status_code == 403

    def test_the_nav_links_to_it_only_for_staff(self, customer_client, staff_client) -> None:
        assert 'href="/pool/"' not in customer_client.get("/").content.decode()
        assert 'href="/pool/"' in staff_client.get("/").content.decode()


def test_an_outsider_sees_none_of_a_hosts_pages_even_as_a_host_owner(serving_host, outsider) -> None:
    client = signed_in(outsider.host.owner)
    make_host(name="third")
    assert client.get(f"/machines/{serving_host.host.pk}/").status_code == 404
    assert client.get(f"/machines/{outsider.host.pk}/").status_code == 200


def reset_user(email: str) -> str:
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_user(username=email, email=email, password="correct horse battery")
    return email


class BruteForceTests:
    """Login and sign-up are rate-limited (issue 17): django-axes locks an e-mail out from one
    address after LOGIN_FAILURE_LIMIT wrong passwords; sign-ups per address are limited."""

    def test_wrong_passwords_lock_that_email_out_from_that_address_only(self, customer, settings) -> None:
        settings.AXES_FAILURE_LIMIT = 3
        customer.user.set_password("the right password")
        customer.user.save()
        attacker = Client(REMOTE_ADDR="203.0.113.9")
        for _ in range(3):
            attacker.post("/login/", {"username": customer.user.username, "password": "guess"})
        locked = attacker.post("/login/", {"username": customer.user.username, "password": "the right password"})
        assert locked.status_code == 429 and "Too many failed attempts" in locked.content.decode()
        elsewhere = Client(REMOTE_ADDR="198.51.100.7").post(
            "/login/", {"username": customer.user.username, "password": "the right password"}
        )
        assert elsewhere.status_code == 302, "the owner, from their own address, is not locked out"

    def test_reset_mails_for_one_address_are_limited_whoever_asks(self, db, settings) -> None:
        settings.PASSWORD_RESET_EMAIL_RATE = "2/h"
        email = reset_user("r@example.com")
        answers = [
            Client(REMOTE_ADDR=f"203.0.113.{20 + i}").post("/password-reset/", {"email": email.upper() if i else email})
            for i in range(3)
        ]
        assert [answer.status_code for answer in answers] == [302, 302, 429]
        assert "Too many reset links" in answers[2].content.decode()
        assert len([m for m in mail.outbox if email in m.to]) == 2, "the limited one sends nothing"
        nobody = [
            Client(REMOTE_ADDR=f"198.51.100.{i}").post("/password-reset/", {"email": "nobody@example.com"}).status_code
            for i in range(3)
        ]
        assert nobody == [302, 302, 429], "an address with no account is limited alike: the limit reveals nothing"

    def test_reset_mails_from_one_client_address_are_limited(self, db, settings) -> None:
        settings.PASSWORD_RESET_IP_RATE = "2/h"
        email = reset_user("s@example.com")
        client = Client(REMOTE_ADDR="203.0.113.30")
        answers = [client.post("/password-reset/", {"email": f"r{i}@example.com"}).status_code for i in range(2)]
        assert answers + [client.post("/password-reset/", {"email": email}).status_code] == [302, 302, 429]
        assert not [m for m in mail.outbox if email in m.to]
        assert Client(REMOTE_ADDR="203.0.113.31").post("/password-reset/", {"email": email}).status_code == 302
        assert len([m for m in mail.outbox if email in m.to]) == 1

    def test_sign_ups_from_one_address_are_limited(self, db, settings) -> None:
        from django.core.cache import cache

        cache.clear()
        settings.SIGNUP_RATE = "2/h"
        client = Client(REMOTE_ADDR="203.0.113.10")
        answers = [
            client.post("/signup/", {"email": f"s{i}@example.com", "password": "correct horse battery"}).status_code
            for i in range(3)
        ]
        assert answers == [200, 200, 429]
        assert (
            Client(REMOTE_ADDR="203.0.113.11")
            .post("/signup/", {"email": "other@example.com", "password": "correct horse battery"})
            .status_code
            == 200
        )
