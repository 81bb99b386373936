"""Many customers per machine (issue 51), end to end: a real mahout started with `--slots 4`
serves four customers' streams at once from its one model load, under the real gateway, and
the `openai` client sees nothing different: a greedy answer generated beside three others is
the answer it gets alone, each request is billed its own tokens, and nobody waits for a slot."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import openai
import pytest

from billing import selectors as ledger
from conftest import make_customer, make_host
from hosts.models import Host
from marketplace.models import Job, Request

if TYPE_CHECKING:
    from collections.abc import Callable

    from catalog.models import CatalogModel
    from testkit.personas import Customer
    from testkit.stack import Gateway, Mahout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

SLOTS = 4
MAX_TOKENS = 40
QUESTIONS = (
    "Write a haiku about elephants.",
    "Name three rivers in Africa.",
    "What is the capital of France?",
    "Describe a sunrise in one sentence.",
)


def ask(gateway: Gateway, customer: Customer, question: str) -> tuple[str, str]:
    """A streamed greedy chat, as a customer sends it: (the answer's public id, its text)."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=90)
    stream = client.chat.completions.create(
        model="gemma-3-270m",
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        seed=7,
        stream=True,
    )
    public_id, text = "", []
    for chunk in stream:
        public_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return public_id, "".join(text)


def test_a_host_with_four_slots_serves_four_customers_at_once_each_as_if_alone(
    gateway: Gateway,
    catalog: CatalogModel,
    start_mahout: Callable[..., Mahout],
) -> None:
    host = make_host(qualified=False, name="slots-rig")
    process = start_mahout(host.token, extra=["--slots", str(SLOTS)])
    assert Host.objects.get(pk=host.host.pk).slots == SLOTS, "its heartbeat says how many jobs it takes at once"
    customers = [make_customer() for _ in QUESTIONS]
    alone = {question: ask(gateway, customers[0], question)[1] for question in QUESTIONS[:2]}

    answers: dict[str, tuple[str, str]] = {}
    failures: list[BaseException] = []

    def customer_asks(customer: Customer, question: str) -> None:
        try:
            answers[question] = ask(gateway, customer, question)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the others
            failures.append(exc)

    threads = [threading.Thread(target=customer_asks, args=pair) for pair in zip(customers, QUESTIONS, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures
    for question in QUESTIONS[:2]:
        assert answers[question][1] == alone[question], "a greedy answer beside three others is the answer alone"

    rows = [Request.objects.get(public_id=answers[question][0]) for question in QUESTIONS]
    assert all(row.status == "completed" and row.completion_tokens > 0 for row in rows)
    jobs = [row.jobs.get() for row in rows]
    assert {job.host_id for job in jobs} == {host.host.pk}
    assert max(job.claimed_at for job in jobs) < min(job.finished_at for job in jobs), "all four ran at once"
    for row, job in zip(rows, jobs, strict=True):
        assert (
            row.cost_ucents
            == row.prompt_tokens * catalog.input_price_ucents + row.completion_tokens * catalog.output_price_ucents
        )
        assert job.earned_ucents == row.cost_ucents * 80 // 100
    assert ledger.ledger_total() == 0 and ledger.cache_drift() == []
    assert f"{SLOTS} job(s) at once" in process.output()
    assert not Job.objects.exclude(status="completed").exists()
