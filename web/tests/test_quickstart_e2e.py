"""The Quickstart page's snippets, run as printed against a real gateway and real hosts: what
a newcomer copies must work."""

from __future__ import annotations

import html
import re
import subprocess
import sys

import httpx
import pytest

from conftest import ROOT, make_customer, make_host, stack_env, wait_until
from web.tests.conftest import signed_in

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


def snippet(page: str, name: str) -> str:
    """The text a visitor copies from the page (the Copy button copies the <pre>'s text)."""
    found = re.search(rf'<pre id="snippet-{name}"><code>(.*?)</code></pre>', page, re.S)
    assert found, f"no {name} snippet on the page"
    return html.unescape(found.group(1))


def run(code: str, *, secret: str) -> subprocess.CompletedProcess[str]:
    env = {**stack_env(), "ELEPHANT_API_KEY": secret}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


class QuickstartSnippetTests:
    def test_each_snippet_runs_as_printed_and_is_answered(self, gateway, catalog, start_mahout) -> None:
        start_mahout(make_host(qualified=False, name="qs-chat").token)
        start_mahout(make_host(qualified=False, name="qs-embeddings").token, extra=["--models", "all-minilm-l6-v2"])
        customer = make_customer()
        host = gateway.url.removeprefix("http://")
        page = signed_in(customer.user).get("/quickstart/", HTTP_HOST=host).content.decode()
        chat, embeddings = snippet(page, "chat"), snippet(page, "embeddings")
        assert f'base_url="{gateway.url}/v1"' in chat and 'model="gemma-3-270m"' in chat
        assert 'model="all-minilm-l6-v2"' in embeddings

        def models_listed() -> bool:
            listed = httpx.get(
                f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {customer.secret}"}, timeout=5
            )
            return {"gemma-3-270m", "all-minilm-l6-v2"} <= {m["id"] for m in listed.json().get("data", [])}

        wait_until(models_listed, timeout=20, what="both models served", interval=0.5)
        chatted = run(chat, secret=customer.secret)
        assert chatted.returncode == 0, chatted.stderr[-3000:]
        assert chatted.stdout.strip(), "the stream printed an answer"
        embedded = run(embeddings, secret=customer.secret)
        assert embedded.returncode == 0, embedded.stderr[-3000:]
        lines = embedded.stdout.strip().splitlines()
        assert [line.split()[:2] for line in lines] == [["0", "384"], ["1", "384"]]
