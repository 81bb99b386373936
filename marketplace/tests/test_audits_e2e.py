"""Audits end to end: a real gateway with audits on, a real mahout serving sampled chats
(every job of a host in probation is audited), and a cheat that answers junk; the audits
run here, under the real model, as the Celery workers run them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from billing import selectors as ledger
from billing.models import Account
from catalog.tokenizer import tokenizer_for
from conftest import make_customer, make_host, wait_until
from hosts.models import Host
from mahout import __version__ as mahout_version
from marketplace.models import Audit, Request
from marketplace.trust import audit_scoring
from testkit.stack import Gateway, Mahout, stack_env

if TYPE_CHECKING:
    from catalog.models import CatalogModel

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.audits]

ASKS = [
    (
        {"temperature": 0.7},
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three large animals."}],
    ),
    ({"temperature": 1.2, "top_p": 0.9}, [{"role": "user", "content": "Write one line about rivers."}]),
    ({"temperature": 0.0}, [{"role": "user", "content": "Count from one to five."}]),
    (
        {"temperature": 0.8, "response_format": {"type": "json_object"}},
        [{"role": "user", "content": "Describe a cat as JSON."}],
    ),
    (
        {"temperature": 0.9, "logprobs": True, "top_logprobs": 2},
        [{"role": "user", "content": "Say something about the sea."}],
    ),
]


@pytest.fixture
def audited_gateway(django_db_blocker, e2e_dirs: Path, transactional_db: None) -> Iterator[Gateway]:  # noqa: ANN001
    with django_db_blocker.unblock():
        env = stack_env({"AUDIT_ENABLED": "1", "AUDIT_PROBATION_RATE": "1", "QUEUE_TIMEOUT_SECONDS": "30"})
    gateway = Gateway(env, e2e_dirs / "logs")
    yield gateway
    gateway.stop()


def _customer_balance(customer) -> int:  # noqa: ANN001
    return ledger.customer_account(user=customer.user).balance_ucents


def test_an_honest_host_passes_its_audits_and_is_paid(
    audited_gateway: Gateway, catalog: CatalogModel, e2e_dirs: Path, settings
) -> None:  # noqa: ANN001
    serving = make_host(qualified=False, name="honest")
    host = Mahout(
        server=audited_gateway.url,
        token=serving.token,
        home=e2e_dirs / "mahout-home",
        env=stack_env(),
        log_dir=e2e_dirs / "logs",
    )
    try:
        wait_until(
            lambda: Host.objects.filter(pk=serving.host.pk, qualifications__isnull=False).exists(),
            timeout=180,
            what="the host to qualify",
        )
        customer = make_customer()
        client = openai.OpenAI(
            base_url=f"{audited_gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=120
        )
        for params, messages in ASKS:
            answer = client.chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=40, **params)
            assert answer.choices[0].message.content is not None
    finally:
        host.stop()
    pending = list(Audit.objects.filter(host=serving.host))
    assert len(pending) == len(ASKS) and all(a.status == Audit.Status.PENDING and a.token_ids for a in pending)
    (reported,) = [a for a in pending if a.logprobs is not None]  # kept for the one job that asked for them
    assert len(reported.logprobs) > 0 and all("logprob" in entry for entry in reported.logprobs)
    altered = [dict(entry) for entry in reported.logprobs]
    altered[0]["logprob"] -= 3.0  # a host that reports numbers its model did not compute
    reported.logprobs = altered
    settings.AUDIT_TOKENS = 0  # every token: the altered entry's among them (16 drawn could miss it)
    reason, _ = audit_scoring.audit_verdict(reported)  # the verdict alone: nothing is decided or saved
    settings.AUDIT_TOKENS = 16
    assert reason is not None and "log-probabilities are not the model's" in reason
    assert ledger.host_account(host=serving.host) is None or ledger.host_account(host=serving.host).balance_ucents == 0
    assert audit_scoring.audit_score_pending() == len(ASKS)
    decided = list(Audit.objects.filter(host=serving.host))
    assert [a.status for a in decided] == [Audit.Status.PASSED] * len(ASKS), [a.reason for a in decided]
    assert all(a.checked > 0 and a.misses == 0 and a.payload is None and a.text == "" for a in decided)
    assert ledger.host_account(host=serving.host).balance_ucents == sum(a.host_ucents for a in decided) > 0
    assert Account.objects.get(kind=Account.Kind.AUDIT_ESCROW).balance_ucents == 0
    serving.host.refresh_from_db()
    assert serving.host.maintenance_since is None


def test_a_host_that_answers_junk_is_caught_and_its_customer_refunded(
    audited_gateway: Gateway, catalog: CatalogModel
) -> None:
    """A cheat that heartbeats like mahout and answers with fluent junk and made-up tokens."""
    cheat = make_host(name="junk")
    customer = make_customer()
    before = _customer_balance(customer)
    headers = {"Authorization": f"Bearer {cheat.token}"}
    with httpx.Client(base_url=audited_gateway.url, headers=headers, timeout=30) as http:
        assert (
            http.post(
                "/hosts/api/heartbeat", json={"fingerprint": cheat.fingerprint, "version": mahout_version}
            ).status_code
            == 200
        )
        with httpx.Client(base_url=f"{audited_gateway.url}/v1", timeout=60) as api:
            import threading

            answers: list[dict] = []
            ask = threading.Thread(
                target=lambda: answers.append(
                    api.post(
                        "/chat/completions",
                        headers={"Authorization": f"Bearer {customer.secret}"},
                        json={"model": "gemma-3-270m", "messages": ASKS[0][1], "max_tokens": 40, "temperature": 0.8},
                    ).json()
                )
            )
            ask.start()
            claimed = http.post("/hosts/api/claim", json={"fingerprint": cheat.fingerprint, "wait": 20}).json()["job"]
            junk = "Elephants are wonderful animals that live in many places."
            tokens = tokenizer_for("shipped:gemma-3-270m")._llama.tokenize(junk.encode(), add_bos=False, special=False)
            assert http.post(f"/hosts/api/jobs/{claimed['id']}/tokens", json={"seq": 0, "text": junk}).json()[
                "accepted"
            ]
            done = http.post(
                f"/hosts/api/jobs/{claimed['id']}/complete",
                json={"finish_reason": "stop", "tokens": [*tokens, 1], "seed": 1},
            )  # its text's own tokens, then EOS
            assert done.status_code == 200, done.text
            ask.join(timeout=60)
    assert answers and answers[0]["choices"][0]["message"]["content"] == junk  # the customer got it, and was billed
    request = Request.objects.get(public_id=answers[0]["id"])
    assert request.cost_ucents > 0 and _customer_balance(customer) == before - request.cost_ucents
    assert audit_scoring.audit_score_pending() == 1
    audit = Audit.objects.get(request=request)
    assert audit.status == Audit.Status.FAILED and audit.reason
    assert _customer_balance(customer) == before  # refunded to the µ¢
    cheat.host.refresh_from_db()
    assert cheat.host.maintenance_since is not None and "Failed verification" in cheat.host.maintenance_reason
    assert ledger.host_account(host=cheat.host) is None or ledger.host_account(host=cheat.host).balance_ucents == 0
    assert ledger.reconcile_report() == []
