"""A real browser against a real gateway: sign up, top up, create a key, see it once.

Drives the system Chromium (/usr/bin/chromium) through Playwright's Python
package (its wheel carries the driver; no `playwright install`). The gateway runs
in local test mode as `make run` starts it: Stripe is the shipped stand-in
(`manage.py stripe_local`, a process of its own), so a top-up goes through its payment
page and its signed webhook. Screenshots go to $SCREENSHOTS_DIR (docs/screenshots/
when refreshing the documentation) or to the test's temporary folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from testkit.stack import ROOT, Gateway, free_port, mail_link, stack_env, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from pytest_django import DjangoDbBlocker

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="no system Chromium at /usr/bin/chromium (apt-get install chromium)"
    ),
]
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -r requirements.txt)"
)


class TestModeGateway(Gateway):
    stripe_url = ""  # its Stripe stand-in


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker: DjangoDbBlocker, e2e_dirs: Path) -> Iterator[TestModeGateway]:
    """This module's gateway, in local test mode: its Stripe is the shipped stand-in, started
    as `make run` starts it (its own process and port, the same test keys on both sides)."""
    stripe_port = free_port()
    keys = {"STRIPE_SECRET_KEY": "sk_test_local_browser", "STRIPE_WEBHOOK_SECRET": "whsec_local_browser"}
    with django_db_blocker.unblock():
        env = stack_env({**keys, "STRIPE_API_BASE": f"http://127.0.0.1:{stripe_port}"})
    gw = TestModeGateway(env, e2e_dirs / "logs")
    gw.stripe_url = f"http://127.0.0.1:{stripe_port}"
    stand_in = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "stripe_local",
            "--port",
            str(stripe_port),
            "--webhook-url",
            f"{gw.url}/billing/stripe/webhook/",
            "--state",
            str(e2e_dirs / "stripe-local.json"),
        ],  # not the checkout's var/: a second run would replay this one's answers
        cwd=ROOT,
        env={**os.environ, **keys},
        stdout=open(e2e_dirs / "logs" / "stripe-local.log", "w"),
        stderr=subprocess.STDOUT,
    )

    def listening() -> bool:
        assert stand_in.poll() is None, (e2e_dirs / "logs" / "stripe-local.log").read_text()
        try:
            return httpx.get(f"{gw.stripe_url}/v1/accounts/none", timeout=1).status_code == 401
        except httpx.HTTPError:
            return False

    wait_until(listening, timeout=60, what="the Stripe stand-in to listen")
    yield gw
    stand_in.terminate()
    stand_in.wait(timeout=20)
    gw.stop()


def top_up_in_test_mode(page: sync_api.Page, gateway: TestModeGateway, usd: str) -> tuple[str, str]:
    """The dashboard's top-up, paid on the stand-in's payment page: the balance before and after."""
    page.goto(f"{gateway.url}/")
    before = page.inner_text("#balance")
    assert page.is_visible("#test-mode"), "test mode is labelled on the page"
    page.fill("input[name=amount_usd]", usd)
    page.click("button:has-text('Pay with Stripe')")
    page.wait_for_url(f"{gateway.stripe_url}/c/pay/*")  # the local payment page, not Stripe's
    assert page.is_visible("#test-mode") and f"{usd}.00 USD" in page.inner_text("#amount")
    page.click("button:has-text('Pay')")  # it sends Stripe's signed webhook, then returns to success_url
    page.wait_for_url(f"{gateway.url}/?topup=success")
    return before, page.inner_text("#balance")


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SCREENSHOTS_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class BrowserTests:
    def test_a_visitor_signs_up_creates_a_key_and_sees_its_secret_once(self, gateway, transactional_db, shots) -> None:
        assert httpx.get(f"{gateway.url}/static/css/web.css", timeout=5).status_code == 200  # served by the project
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 390, "height": 844})  # a phone
            page.goto(f"{gateway.url}/")
            assert page.url.endswith("/login/?next=/")
            page.click("text=Create an account")
            page.fill("input[name=email]", "browser@example.com")
            page.fill("input[name=password]", "a long enough password")
            page.screenshot(path=shots / "signup.png", full_page=True)
            page.click("button:has-text('Sign up')")
            page.wait_for_selector("#signup-sent")
            page.goto(
                mail_link(to="browser@example.com", pattern=r"(http://\S+/verify/\S+/)")
            )  # the link in the e-mail
            page.fill(
                "input[name=password]", "a long enough password"
            )  # the link confirms only with the sign-up's password
            page.click("button:has-text('Confirm and sign in')")
            page.wait_for_url(f"{gateway.url}/keys/")
            page.fill("input[name=name]", "laptop")
            page.fill("input[name=cap_usd]", "5")
            page.click("button:has-text('Create key')")
            secret = page.inner_text("#new-secret").strip()
            assert re.fullmatch(r"el-[\w-]{40}", secret)
            page.screenshot(path=shots / "keys-new-secret.png", full_page=True)
            page.goto(f"{gateway.url}/keys/")
            listing = page.content()
            page.goto(f"{gateway.url}/")
            page.screenshot(path=shots / "dashboard.png", full_page=True)
            page.goto(f"{gateway.url}/machines/")
            page.fill("input[name=name]", "desk")
            page.click("button:has-text('Register machine')")
            command = page.inner_text("#host-command").strip()
            token = page.inner_text("#host-token").strip()
            page.wait_for_selector("tr[data-host] [data-status]:has-text('offline')")
            page.screenshot(path=shots / "machines-new-host.png", full_page=True)
            page.goto(f"{gateway.url}/usage/")
            page.screenshot(path=shots / "usage.png", full_page=True)
            browser.close()
        # (a first line installs the wheel where the operator built it: `make mahout-wheel`)
        assert command.endswith(f"mahout login --server {gateway.url}\nmahout run") and token.startswith("host-")
        assert secret not in listing and secret[:12] in listing and "$5.00" in listing
        assert (
            httpx.get(f"{gateway.url}/v1/usage", headers={"Authorization": f"Bearer {secret}"}, timeout=5).status_code
            == 200
        )

    def test_a_customer_sees_the_call_and_a_host_sees_its_machine_online_then_busy(
        self, gateway, transactional_db, catalog, tmp_path
    ) -> None:
        import shlex
        import threading

        import openai

        env = stack_env()
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(f"{gateway.url}/signup/")
            page.fill("input[name=email]", "flow@example.com")
            page.fill("input[name=password]", "a long enough password")
            page.click("button:has-text('Sign up')")
            page.wait_for_selector("#signup-sent")
            page.goto(mail_link(to="flow@example.com", pattern=r"(http://\S+/verify/\S+/)"))
            page.fill("input[name=password]", "a long enough password")
            page.click("button:has-text('Confirm and sign in')")
            page.wait_for_url(f"{gateway.url}/keys/")
            balance_before, balance_after = top_up_in_test_mode(page, gateway, "5")
            page.goto(f"{gateway.url}/keys/")
            page.fill("input[name=name]", "script")
            page.click("button:has-text('Create key')")
            secret = page.inner_text("#new-secret").strip()
            page.goto(f"{gateway.url}/machines/")
            page.fill("input[name=name]", "rig")
            page.click("button:has-text('Register machine')")
            # (a `pip install` line comes first where the operator built the wheel: `make mahout-wheel`)
            login, run = (shlex.split(line) for line in page.inner_text("#host-command").strip().splitlines()[-2:])
            token = page.inner_text("#host-token").strip()
            assert login[:2] == ["mahout", "login"] and run == ["mahout", "run"]
            home = str(tmp_path / "mahout")
            subprocess.run(
                [sys.executable, "-m", *login, "--home", home, "--token-stdin"],
                input=token + "\n",
                text=True,
                cwd=ROOT,
                env=env,
                check=True,
                capture_output=True,
                timeout=60,
            )  # the owner pastes the token
            host = subprocess.Popen(
                [sys.executable, "-m", *run, "--home", home, "--threads", "1"],
                cwd=ROOT,
                env=env,
                stdout=open(tmp_path / "mahout.log", "w"),
                stderr=subprocess.STDOUT,
            )
            try:
                page.goto(f"{gateway.url}/machines/")
                try:
                    page.wait_for_selector("tr[data-host] [data-status]:has-text('online')", timeout=120_000)
                except sync_api.TimeoutError:
                    raise AssertionError((tmp_path / "mahout.log").read_text()[-3000:]) from None
                client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0, timeout=120)
                answers: list[str] = []
                # ~1,000 greedy tokens run well past the page's 3 s poll (200 took 2.5 s on a fast machine)
                call = threading.Thread(
                    target=lambda: answers.append(
                        client.completions.create(
                            model="gemma-3-270m", prompt="Once upon a time", max_tokens=1000, temperature=0
                        ).id
                    )
                )
                call.start()
                page.wait_for_selector("tr[data-host] [data-status]:has-text('busy')", timeout=30_000)
                call.join(timeout=120)
                page.goto(f"{gateway.url}/usage/")
                usage = page.inner_text("main") if page.query_selector("main") else page.content()
            finally:
                host.kill()
                browser.close()
        assert (balance_before, balance_after) == ("$0.00", "$5.00"), (
            "the top-up paid in test mode is the credit that paid the call"
        )
        assert answers and answers[0] in usage, "the request appears on the usage page"
        assert re.search(r"\b1 request\b|^Requests\n1$", usage, re.MULTILINE), (
            "one request counted"
        )  # (either layout of the page)

    def test_an_owner_sees_maintenance_arrive_live_with_its_reason_and_resumes(
        self, gateway, transactional_db, shots
    ) -> None:
        import threading

        from django.contrib.auth import get_user_model
        from django.utils import timezone

        from hosts.models import Host
        from hosts.services import host_create, host_maintenance_enter

        email = "owner@example.com"
        get_user_model().objects.create_user(username=email, email=email, password="a long enough password")
        host = host_create(email=email, name="den").host

        def off_loop(work: Callable[[], object]) -> None:
            """The ORM may not run on Playwright's event loop; run it on a thread of its own."""
            thread = threading.Thread(target=work)
            thread.start()
            thread.join()

        def heartbeat() -> None:
            Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now())

        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 390, "height": 844})
            page.goto(f"{gateway.url}/login/")
            page.fill("input[name=username]", email)
            page.fill("input[name=password]", "a long enough password")
            page.click("button:has-text('Log in')")
            page.wait_for_url(f"{gateway.url}/")
            off_loop(heartbeat)
            page.goto(f"{gateway.url}/machines/")
            page.wait_for_selector("tr[data-host] [data-status]:has-text('online')")
            assert not page.is_visible("tr[data-host] [data-maintenance]")
            off_loop(heartbeat)
            reason_set = "Fan failure reported; please check the cooling"
            off_loop(
                lambda: host_maintenance_enter(host=host, reason=reason_set, by="automatic")
            )  # the owner's to lift
            page.wait_for_selector(
                "tr[data-host] [data-status]:has-text('maintenance')", timeout=10_000
            )  # the 3 s poll
            reason = page.inner_text("tr[data-host] [data-maintenance] [data-reason]")
            setter = page.inner_text("tr[data-host] [data-maintenance] [data-by]")
            assert page.is_visible("tr[data-host] [data-maintenance] button:has-text('Resume')")
            page.screenshot(path=shots / "machines-maintenance.png", full_page=True)
            page.click("tr[data-host] button:has-text('Resume')")
            page.wait_for_url(f"{gateway.url}/machines/")
            resumed = page.inner_text("main")
            badge = page.inner_text("tr[data-host] [data-status]")
            hidden = not page.is_visible("tr[data-host] [data-maintenance]")
            browser.close()
        assert reason == reason_set
        assert setter.startswith("the reliability rule")
        assert "den is out of maintenance" in resumed and badge != "maintenance" and hidden
