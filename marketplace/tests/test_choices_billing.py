"""An `n` request bills its prompt once, as OpenAI does and as its `usage` counts it: the first
choice pays the prompt, the later ones only their own output; `GET /v1/generation` shows the
whole request's cost."""

from __future__ import annotations

import asyncio

import pytest
from django.test import Client

from catalog.pricing import price
from marketplace import services
from marketplace.models import CHOICE_OF, Request
from marketplace.openai.choices import admit_choices
from marketplace.tests.test_reputation import online
from testkit.evidence import drawn

pytestmark = pytest.mark.django_db(transaction=True)


def _admitted(customer, n: int) -> list[Request]:  # noqa: ANN001
    async def admit() -> list[Request]:
        choices = await admit_choices(
            secret=customer.secret,
            kind=Request.Kind.CHAT,
            body={
                "model": "gemma-3-270m",
                "n": n,
                "max_tokens": 12,
                "seed": 7,
                "messages": [{"role": "user", "content": "Name three colours, please, and say why you like them."}],
            },
        )
        for choice in choices:
            await choice.listener.close()
        return [choice.row for choice in choices]

    return asyncio.run(admit())


def test_an_n_request_bills_its_prompt_once_and_its_generation_shows_all_of_it(customer, catalog, serving_host) -> None:
    first, second = _admitted(customer, 2)
    assert second.params[CHOICE_OF] == first.public_id and CHOICE_OF not in first.params
    assert first.prompt_tokens == second.prompt_tokens > 0
    assert second.estimate_ucents == price(catalog, prompt_tokens=0, completion_tokens=12)  # its hold holds no prompt
    online(serving_host)
    for text in ("Red, green, blue.", "Teal and amber."):
        sent = services.job_claim_payload(host=serving_host.host, model_ids=[catalog.pk])
        assert CHOICE_OF not in sent["params"]  # which choice it is stays the gateway's
        services.job_push_tokens(host=serving_host.host, job_id=sent["id"], seq=0, text=text)
        services.job_complete(
            host=serving_host.host, job_id=sent["id"], finish_reason="stop", token_ids=drawn(sent["id"])
        )
    first.refresh_from_db()
    second.refresh_from_db()
    completion = first.completion_tokens + second.completion_tokens
    assert first.cost_ucents + second.cost_ucents == price(
        catalog, prompt_tokens=first.prompt_tokens, completion_tokens=completion
    )
    body = (
        Client()
        .get(f"/v1/generation?id={first.public_id}", headers={"Authorization": f"Bearer {customer.secret}"})
        .json()
    )
    assert (body["choices"], body["prompt_tokens"], body["completion_tokens"]) == (2, first.prompt_tokens, completion)
    assert body["cost_ucents"] == first.cost_ucents + second.cost_ucents
