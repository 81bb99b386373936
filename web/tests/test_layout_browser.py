"""Every page at 1280×800 in a real browser: nothing wider than its container.

A customer with a month of usage (two models, three keys, long ids, large and exactly-written
amounts) and a machine owner (an operator too, for the pool page) each visit every page; the
test fails on a page that scrolls sideways or any element whose content is wider than its box
(a table clipped or hidden behind a horizontal scroll, a tile whose amount spills out).
Drives the system Chromium as test_browser.py does. Screenshots go to $SCREENSHOTS_DIR or
the test's temporary folder.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
VIEWPORT = {"width": 1280, "height": 800}
PASSWORD = "a long enough password"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="no system Chromium at /usr/bin/chromium (apt-get install chromium)"
    ),
]
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -r requirements.txt)"
)

# Every block element whose content is wider than its box; the page itself if it scrolls sideways.
# Form controls and SVG are left out (an input's text may be longer than the input by design).
OVERFLOWS = """() => {
  const path = el => {
    const parts = [];
    for (let node = el; node && node !== document.body && parts.length < 4; node = node.parentElement) {
      parts.unshift(node.tagName.toLowerCase() + (node.id ? '#' + node.id : '')
        + (typeof node.className === 'string' && node.className.trim() \
? '.' + node.className.trim().split(/\\s+/).join('.') : ''));
    }
    return parts.join(' > ');
  };
  const found = [];
  const root = document.scrollingElement;
  if (root.scrollWidth > root.clientWidth) \
found.push(`the page scrolls sideways: ${root.scrollWidth}px in ${root.clientWidth}px`);
  for (const el of document.querySelectorAll('body *')) {
    if (['INPUT', 'SELECT', 'TEXTAREA', 'BUTTON', 'OPTION'].includes(el.tagName) || el instanceof SVGElement) continue;
    const style = getComputedStyle(el);
    if (style.display === 'inline' || style.display === 'none' || el.clientWidth === 0) continue;
    if (el.scrollWidth > el.clientWidth + 1) \
found.push(`${path(el)}: content ${el.scrollWidth}px wide in ${el.clientWidth}px`);
  }
  return found;
}"""


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SCREENSHOTS_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def customer_with_usage() -> str:
    """A customer with a month of requests on two models and three keys, top-ups, and a large
    balance written to the micro-cent; returns the e-mail to sign in with."""
    from django.utils import timezone

    from accounts.services import api_key_create
    from billing.models import TopUp
    from billing.services import credit_grant
    from catalog.models import CatalogModel
    from conftest import make_customer
    from marketplace.models import Request
    from web.tests.factories import finished_request

    email = f"usage-{uuid.uuid4().hex[:6]}@example.com"
    customer = make_customer(email=email, credit_ucents=1_234_567_891_234)
    customer.user.set_password(PASSWORD)
    customer.user.email = email
    customer.user.save()
    credit_grant(user=customer.user, amount_ucents=123_456_789, reference=f"test-{uuid.uuid4()}")
    keys = [
        customer.key,
        *(
            api_key_create(user=customer.user, name=name, spend_cap_ucents=cap).key
            for name, cap in [("a production server with a long name", 987_654_321_098), ("laptop", None)]
        ),
    ]
    embeddings = CatalogModel.objects.get(name="all-minilm-l6-v2")
    now = timezone.now()
    for n in range(24):
        customer.key = keys[n % 3]
        request = finished_request(
            customer=customer, cost_ucents=123_456_789 + n * 1_111, resumed=n % 5 == 0, failed=n % 7 == 6
        )
        Request.objects.filter(pk=request.pk).update(
            created_at=now - timedelta(days=n, hours=n),
            prompt_tokens=123_456 + n,
            completion_tokens=65_432 + n,
            **({"model": embeddings} if n % 4 == 3 else {}),
            **({"error_code": "no_host_available_within_timeout"} if n % 7 == 6 else {}),
        )
    for cents, status, refunded in [(50_000, "paid", 1_234), (2_000, "open", 0), (500, "failed", 0)]:
        paid = (
            credit_grant(user=customer.user, amount_ucents=cents * 1_000_000, reference=f"test-{uuid.uuid4()}")
            if status == "paid"
            else None
        )  # (a paid top-up has its ledger transaction)
        TopUp.objects.create(
            user=customer.user,
            amount_cents=cents,
            status=status,
            refunded_cents=refunded,
            transaction=paid,
            paid_at=now if paid else None,
            stripe_session_id=f"cs_{uuid.uuid4().hex}",
        )
    return email


def owner_with_earnings() -> tuple[str, int]:
    """A machine owner (an operator as well: the pool page) whose host benchmarked the shipped
    model and earned large, exactly-written amounts; returns the e-mail and the host's id."""
    from django.contrib.auth import get_user_model

    from conftest import make_customer, make_host
    from hosts.models import Host
    from web.tests.factories import finished_request

    serving = make_host(name="a-workstation-with-a-rather-long-hostname-under-the-desk")
    owner = serving.host.owner
    owner.email = owner.username
    owner.is_staff = True
    owner.set_password(PASSWORD)
    owner.save()
    Host.objects.filter(pk=serving.host.pk).update(version="0.9.0", maintenance_reason="")
    payer = make_customer(credit_ucents=9_999_999_999_999)
    for n in range(6):
        finished_request(customer=payer, host=serving.host, cost_ucents=123_456_789_012 + n * 7)
    get_user_model().objects.filter(pk=owner.pk).update(is_staff=True)
    return owner.username, serving.host.pk


def sign_in(page: object, url: str, email: str) -> None:
    page.goto(f"{url}/login/")
    page.fill("input[name=username]", email)
    page.fill("input[name=password]", PASSWORD)
    page.click("button:has-text('Log in')")
    page.wait_for_url(f"{url}/")


class LayoutTests:
    def test_no_page_is_wider_than_its_container_at_1280(self, gateway, transactional_db, catalog, shots) -> None:
        customer = customer_with_usage()
        owner, host_id = owner_with_earnings()
        visits = {
            customer: ["/", "/keys/", "/usage/", "/quickstart/", "/models/", "/machines/"],
            owner: ["/", "/keys/", "/usage/", "/machines/", f"/machines/{host_id}/", "/pool/"],
        }
        problems: dict[str, list[str]] = {}
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            for email, paths in visits.items():
                context = browser.new_context(viewport=VIEWPORT)
                page = context.new_page()
                sign_in(page, gateway.url, email)
                for path in paths:
                    response = page.goto(f"{gateway.url}{path}")
                    assert response is not None and response.status == 200, path
                    name = f"layout-{email.split('@')[0]}{path.replace('/', '-')}".rstrip("-")
                    page.screenshot(path=shots / f"{name}.png", full_page=True)
                    found = page.evaluate(OVERFLOWS)
                    if found:
                        problems[f"{email} {path}"] = found[:6]
                context.close()
            browser.close()
        assert not problems, "wider than their containers at 1280×800:\n" + "\n".join(
            f"{where}:\n  " + "\n  ".join(found) for where, found in problems.items()
        )
