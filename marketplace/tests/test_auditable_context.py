"""Only auditable work is sold (issue 50, item 4): a chat entry's context is at most what its
verifiers and runners read (`protocol.catalog.AUDITABLE_CONTEXT_TOKENS`), whatever its row
says, and a request past it is a 400 before the queue: a longer job could not be audited and
was paid unchecked."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.test import Client

from catalog.models import CatalogModel
from marketplace.models import Job, Request
from marketplace.tests.test_apis import GOOD, assert_error, post
from protocol.catalog import AUDITABLE_CONTEXT_TOKENS

pytestmark = pytest.mark.django_db(transaction=True)  # views run ORM calls on their own threads

# about 400 prompt tokens and 4,000 to write: past what audits read (4,096), within the row's 8,192
LONG = {**GOOD, "max_tokens": 4000, "messages": [{"role": "user", "content": "elephant " * 400}]}


@pytest.fixture
def sold_8k(catalog: CatalogModel) -> CatalogModel:
    """The shipped entry as `catalog_add` made entries before (the file's own context, 8k and
    more), or as an operator's edit leaves it: the row says 8,192."""
    CatalogModel.objects.filter(pk=catalog.pk).update(context_length=8192)
    catalog.refresh_from_db()
    return catalog


def test_verifiers_and_runners_read_the_context_sold() -> None:
    from mahout import catalog as host_catalog
    from scorer.verify import Verifier

    assert host_catalog.RUNNER_N_CTX == AUDITABLE_CONTEXT_TOKENS
    assert Verifier.__init__.__kwdefaults__["n_ctx"] == AUDITABLE_CONTEXT_TOKENS  # the gateway's, as audits build it


def test_a_request_past_the_auditable_context_is_a_400_before_the_queue(customer, sold_8k) -> None:  # noqa: ANN001
    answer = post(Client(), customer.secret, LONG)
    error = assert_error(answer, 400, "context_length_exceeded")
    assert (
        f"context is {AUDITABLE_CONTEXT_TOKENS} tokens" in error["message"] and error["type"] == "invalid_request_error"
    )
    assert not Request.objects.exists() and not Job.objects.exists()


def test_the_listing_says_the_context_sold(customer, sold_8k, serving_host) -> None:  # noqa: ANN001
    from django.core.cache import cache

    from marketplace.selectors import SERVED_MODELS_CACHE_KEY
    from testkit.personas import present

    present(serving_host)  # the listing shows what an online host serves
    cache.delete(SERVED_MODELS_CACHE_KEY)
    listed = Client().get("/v1/models", headers={"Authorization": f"Bearer {customer.secret}"}).json()["data"]
    assert {m["id"]: m["context_length"] for m in listed}["gemma-3-270m"] == AUDITABLE_CONTEXT_TOKENS
    assert sold_8k.context_sold == AUDITABLE_CONTEXT_TOKENS


def test_the_migration_caps_the_chat_entries_catalog_add_made_longer(sold_8k) -> None:  # noqa: ANN001
    embeddings = CatalogModel.objects.get(name="all-minilm-l6-v2")
    migration = importlib.import_module("catalog.migrations.0010_chat_context_at_most_auditable")
    migration.contexts_cap(apps, None)
    assert CatalogModel.objects.get(pk=sold_8k.pk).context_length == AUDITABLE_CONTEXT_TOKENS
    assert CatalogModel.objects.get(pk=embeddings.pk).context_length == embeddings.context_length  # not a chat model
