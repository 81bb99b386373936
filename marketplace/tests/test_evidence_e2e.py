"""Issue 50's first door, tried from outside as its cheat tried it: hosts of our own that
heartbeat like mahout and complete every job they claim at once with nothing, beside an honest
mahout running the shipped model on a real gateway. Customers get the honest host's answers;
nobody is billed for an empty one; the cheats earn nothing; the honest host is never flagged."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from billing import selectors as ledger
from conftest import ROOT, make_customer, make_host, wait_until
from hosts.models import Host
from marketplace.models import Job, Request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


def _cheat(server: str, token: str, how: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testkit.simhost",
            "--server",
            server,
            "--token",
            token,
            "--model",
            "gemma-3-270m",
            "--loaded",
            "gemma-3-270m",
            "--wait",
            "1",
            "--empty",
            how,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _balance(host: Host) -> int:
    account = ledger.host_account(host=host)
    return account.balance_ucents if account else 0


def test_hosts_that_complete_with_nothing_are_paid_nothing_beside_an_honest_one(gateway, catalog, start_mahout) -> None:
    honest = make_host(name="honest")
    start_mahout(honest.token, extra=["--threads", "1"])
    eos_cheat = make_host(name="eos-cheat", fingerprint="e" * 64)
    bare_cheat = make_host(name="bare-cheat", fingerprint="b" * 64)
    cheats = [_cheat(gateway.url, eos_cheat.token, "eos"), _cheat(gateway.url, bare_cheat.token, "bare")]
    customer = make_customer()
    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=customer.secret, max_retries=2, timeout=120)
    try:
        wait_until(
            lambda: (
                Host.objects.filter(
                    pk__in=[eos_cheat.host.pk, bare_cheat.host.pk], last_heartbeat_at__isnull=False
                ).count()
                == 2
            ),
            timeout=30,
            what="both cheats present",
        )
        answers = []
        for turn in range(6):
            answer = api.completions.create(
                model="gemma-3-270m",
                prompt=f"Once upon a time, in village number {turn},",
                max_tokens=12,
                temperature=0.7,
            )
            answers.append(answer)
    finally:
        for proc in cheats:
            proc.terminate()
            proc.wait(timeout=10)
    assert all(answer.choices[0].text for answer in answers), [answer.choices[0].text for answer in answers]
    served = Request.objects.filter(canary__isnull=True, status=Request.Status.COMPLETED)
    assert served.count() == 6 and all(request.cost_ucents > 0 for request in served)
    paid = Job.objects.filter(request__in=served, earned_ucents__gt=0)
    assert set(paid.values_list("host_id", flat=True)) == {
        honest.host.pk
    }  # every answer billed came from the honest host
    for cheat in (eos_cheat, bare_cheat):
        assert _balance(Host.objects.get(pk=cheat.host.pk)) == 0
        assert not Job.objects.filter(host=cheat.host, status=Job.Status.COMPLETED).exists()
    caught = Host.objects.get(pk=eos_cheat.host.pk)  # its empty answer is the first draw, recomputed: proven
    assert caught.maintenance_by == "verification" and "empty answer" in caught.maintenance_reason
    assert Host.objects.get(pk=honest.host.pk).maintenance_since is None
