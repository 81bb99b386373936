"""Model fallbacks (`models`, OpenRouter's convention): the first model with a host online
serves; when its queue times out, the next one is tried; the answer says which served."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING

import openai
import pytest
from django.core.cache import cache
from django.test import Client
from django.utils import timezone

from billing.models import Hold
from catalog.models import CatalogModel
from conftest import make_customer, make_host
from marketplace import services
from marketplace.models import Job, Request
from marketplace.selectors import SERVED_MODELS_CACHE_KEY
from marketplace.tests.test_apis import assert_error, post
from marketplace.tests.test_reputation import claim, online
from testkit.evidence import drawn
from testkit.requests import submit_request

if TYPE_CHECKING:
    from collections.abc import Callable

    from testkit.stack import Gateway, Mahout

pytestmark = pytest.mark.django_db(
    transaction=True
)  # the API views are async: their database threads must see the rows

ASK = [{"role": "user", "content": "Say hi"}]


@pytest.fixture
def spare(catalog) -> CatalogModel:  # noqa: ANN001
    """A second chat model no host serves (the shipped model's twin, at twice its price)."""
    twin = CatalogModel.objects.get(pk=catalog.pk)
    twin.pk, twin.name = None, "gemma-3-270m-spare"
    twin.output_price_ucents *= 2
    twin.save()
    cache.delete(SERVED_MODELS_CACHE_KEY)
    return twin


def chat(customer, body: dict):  # noqa: ANN001, ANN201
    return Client().post(
        "/v1/chat/completions",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
    )


def test_the_first_model_with_a_host_online_serves(customer, serving_host, catalog, spare) -> None:
    online(serving_host)
    cache.delete(SERVED_MODELS_CACHE_KEY)
    response = chat(
        customer, {"model": spare.name, "models": [catalog.name], "messages": ASK, "max_tokens": 4, "stream": True}
    )
    assert response.status_code == 200
    request = Request.objects.get()
    assert request.model == catalog and request.params["fallbacks"] == []


def test_a_queue_timeout_falls_back_to_the_next_model_and_then_ends_honestly(
    customer, serving_host, catalog, spare
) -> None:
    response = chat(
        customer, {"model": catalog.name, "models": [spare.name], "messages": ASK, "max_tokens": 4, "stream": True}
    )
    assert response.status_code == 200
    request = Request.objects.get()
    assert request.model == catalog and request.params["fallbacks"] == [spare.name]  # nobody online: the order asked
    first_hold = request.hold_id
    Job.objects.filter(request=request).update(created_at=timezone.now() - timedelta(hours=1))
    assert services.request_expire_unclaimed(request_id=request.pk)
    request.refresh_from_db()
    assert (request.status, request.model, request.params["fallbacks"]) == (Request.Status.QUEUED, spare, [])
    assert request.hold_id != first_hold, "the spare costs more: its worst case is held anew"
    assert Hold.objects.get(pk=first_hold).status == Hold.Status.RELEASED
    assert Job.objects.filter(request=request, status=Job.Status.QUEUED, model=spare).count() == 1
    Job.objects.filter(request=request).update(created_at=timezone.now() - timedelta(hours=1))
    assert services.request_expire_unclaimed(request_id=request.pk)
    request.refresh_from_db()
    assert (request.status, request.error_code) == (Request.Status.FAILED, "queue_timeout")
    assert not Hold.objects.filter(status=Hold.Status.ACTIVE).exists()


def test_the_fallback_is_served_and_billed_at_its_own_price(customer, serving_host, catalog, spare) -> None:
    request = submit_request(customer, spare, messages=ASK, stream=True, max_tokens=4, fallbacks=[catalog.name])
    Job.objects.filter(request=request).update(created_at=timezone.now() - timedelta(hours=1))
    services.request_expire_unclaimed(request_id=request.pk)
    online(serving_host)
    job = claim(serving_host)
    assert job is not None and job.request_id == request.pk and job.model == catalog
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=" hi")
    services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
    request.refresh_from_db()
    assert request.status == Request.Status.COMPLETED and request.model == catalog
    assert request.hold.amount_ucents >= request.cost_ucents > 0


def test_an_unknown_fallback_is_a_404_naming_it(customer, catalog) -> None:
    error = assert_error(
        post(Client(), customer.secret, {"model": catalog.name, "models": ["gpt-9"], "messages": ASK}),
        404,
        "model_not_found",
    )
    assert error["param"] == "models" and "gpt-9" in error["message"]
    too_many = post(Client(), customer.secret, {"model": catalog.name, "models": [catalog.name] * 5, "messages": ASK})
    assert_error(too_many, 400, "invalid_value")


@pytest.mark.e2e
def test_the_openai_client_is_answered_by_the_fallback_and_told_which(
    gateway: Gateway,
    catalog,
    spare,  # noqa: ANN001
    start_mahout: Callable[..., Mahout],
) -> None:
    start_mahout(make_host(qualified=False, name="fallback-rig").token)
    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=make_customer().secret, max_retries=0, timeout=60)
    whole = api.chat.completions.create(
        model=spare.name, messages=ASK, max_tokens=4, extra_body={"models": [catalog.name]}
    )
    assert whole.model == catalog.name and whole.choices[0].message.content is not None
    chunks = list(
        api.chat.completions.create(
            model=spare.name, messages=ASK, max_tokens=4, stream=True, extra_body={"models": [catalog.name]}
        )
    )
    assert {chunk.model for chunk in chunks} == {catalog.name}
