"""Delivered text is appended, never rewritten: the last batch of a long answer costs what
the first did, and readers see the chunks as one text."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from hosts.models import Host
from marketplace import selectors, services
from marketplace.models import Request, TextChunk
from marketplace.tests.test_services import claimed
from testkit.evidence import drawn

pytestmark = pytest.mark.django_db

BATCH = " five words in a batch"


def push_cost(host: Host, job_id: int, seq: int) -> tuple[int, int]:
    """Statements and bytes of SQL that one batch sends to the database; none of them may
    rewrite a growing text."""
    with CaptureQueriesContext(connection) as queries:
        assert services.job_push_tokens(host=host, job_id=job_id, seq=seq, text=BATCH).accepted
    assert not any("delivered_text" in query["sql"] or "||" in query["sql"] for query in queries)
    return len(queries), sum(len(query["sql"]) for query in queries)


class AppendOnlyTests:
    def test_a_2000_token_answer_costs_the_same_per_batch_at_the_end_as_at_the_start(
        self, customer, serving_host, catalog
    ) -> None:
        request, job = claimed(customer, serving_host, catalog, max_tokens=3000)
        host = serving_host.host
        first = push_cost(host, job.pk, 0)
        for seq in range(1, 399):
            services.job_push_tokens(host=host, job_id=job.pk, seq=seq, text=BATCH)
        last = push_cost(host, job.pk, 399)
        assert last[0] == first[0]
        assert last[1] - first[1] < 40  # longer numbers (seq, offset), never the answer so far
        request.refresh_from_db()
        assert request.delivered_chars == 400 * len(BATCH) == len(request.delivered_text)
        assert TextChunk.objects.filter(request=request).count() == 400
        assert max(len(text) for text in TextChunk.objects.values_list("text", flat=True)) == len(BATCH)

    def test_a_listener_catches_up_from_any_character_even_inside_a_chunk(
        self, customer, serving_host, catalog
    ) -> None:
        request, job = claimed(customer, serving_host, catalog)
        for seq, text in enumerate(["Hello", ", ", "world"]):
            services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=seq, text=text)
        assert [selectors.request_catch_up(public_id=request.public_id, sent=sent)[1] for sent in (0, 3, 5, 7, 12)] == [
            "Hello, world",
            "lo, world",
            ", world",
            "world",
            "",
        ]

    def test_the_text_is_deleted_once_handed_over(self, customer, serving_host, catalog) -> None:
        request, job = claimed(customer, serving_host, catalog)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hi")
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        Request.objects.filter(pk=request.pk).update(params={**request.params, "stop": ["secret ending"]})
        assert services.request_forget_output(request_id=request.pk) is True
        assert services.request_forget_output(request_id=request.pk) is False
        assert not TextChunk.objects.filter(request=request).exists()
        request.refresh_from_db()
        assert "stop" not in request.params and request.params["max_tokens"] == 20, (
            "the customer's text goes with the answer"
        )
        assert (request.messages, request.prompt) == (None, None)
