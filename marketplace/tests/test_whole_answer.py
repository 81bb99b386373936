"""A host that died after its delivered text already ended the answer (issue 33): the answer
is whole, so it settles as complete (billed exactly, not resumed, no host paid) instead of
running a continuation that would add nothing. The host says its generation ended with its
last batch's `finish_reason`, through either door."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from billing import selectors as ledger
from conftest import make_host
from core.errors import DomainError
from marketplace import services
from marketplace.hostdoor.consumers import tokens_frame
from marketplace.models import Job
from marketplace.tests.test_services import submit

pytestmark = pytest.mark.django_db

ANSWER = "The elephant swam across the river."


@pytest.fixture(autouse=True)
def _no_grace(settings) -> None:
    settings.CONTINUATION_GRACE_SECONDS = 0


def assert_settled_whole(
    request,
    customer,
    catalog,
    *,
    text: str,
    finish_reason: str,
    hosts: list,  # noqa: ANN001
    resumed: bool = False,
) -> None:
    """Completed, billed the prompt once and every delivered token once, nobody paid."""
    request.refresh_from_db()
    tokens = services.count_output(request, text)
    assert (request.status, request.finish_reason, request.resumed) == ("completed", finish_reason, resumed)
    assert request.completion_tokens == tokens
    assert (
        request.cost_ucents == request.prompt_tokens * catalog.input_price_ucents + tokens * catalog.output_price_ucents
    )
    assert ledger.customer_account(user=customer.user).balance_ucents == 500_000_000 - request.cost_ucents
    assert all(ledger.host_account(host=host) is None for host in hosts), "a payout needs a completed job"
    assert ledger.ledger_total() == 0 and ledger.reconcile_report() == []


class WholeAnswerTests:
    def test_a_host_dead_after_its_last_batch_said_stop_settles_the_answer(
        self, customer, serving_host, catalog
    ) -> None:
        request = submit(customer, catalog, max_tokens=50)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=ANSWER, finish_reason="stop")
        assert Job.objects.get(pk=job.pk).text_end == "stop"
        assert services.host_connection_lost(host_id=serving_host.host.pk) == 1
        assert not Job.objects.filter(request=request, attempt=2).exists(), "no continuation that adds nothing"
        assert_settled_whole(request, customer, catalog, text=ANSWER, finish_reason="stop", hosts=[serving_host.host])

    def test_an_empty_last_batch_says_it_too_and_a_short_length_is_read_as_stop(
        self, customer, serving_host, catalog
    ) -> None:
        request = submit(customer, catalog, max_tokens=50)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=ANSWER)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=1, text="", finish_reason="length")
        assert services.job_fail(host=serving_host.host, job_id=job.pk, reason="killed") == "settled"
        assert_settled_whole(request, customer, catalog, text=ANSWER, finish_reason="stop", hosts=[serving_host.host])

    def test_a_continuation_that_finished_the_answer_then_died_settles_and_does_not_fail(
        self, customer, serving_host, catalog
    ) -> None:
        request = submit(customer, catalog, max_tokens=50)
        first = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_push_tokens(host=serving_host.host, job_id=first.pk, seq=0, text=ANSWER[:10])
        assert services.host_connection_lost(host_id=serving_host.host.pk) == 1
        rescuer = make_host(name="rescuer")
        continuation = services.job_claim_next(host=rescuer.host, fingerprint=rescuer.fingerprint)
        services.job_push_tokens(
            host=rescuer.host, job_id=continuation.pk, seq=0, text=ANSWER[10:], finish_reason="stop"
        )
        assert services.host_connection_lost(host_id=rescuer.host.pk) == 1
        assert_settled_whole(
            request,
            customer,
            catalog,
            text=ANSWER,
            finish_reason="stop",
            hosts=[serving_host.host, rescuer.host],
            resumed=True,
        )

    def test_without_the_hosts_word_a_death_mid_answer_still_continues(self, customer, serving_host, catalog) -> None:
        request = submit(customer, catalog, max_tokens=50)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=ANSWER)
        assert services.job_fail(host=serving_host.host, job_id=job.pk, reason="killed") == "continued"
        request.refresh_from_db()
        assert request.resumed and Job.objects.filter(request=request, attempt=2, status="queued").exists()


class CompleteGraceTests:
    def test_a_host_silent_after_its_text_ended_is_dead_at_the_grace_not_the_stall_rule(
        self, customer, serving_host, catalog, settings
    ) -> None:
        settings.STALL_SECONDS, settings.COMPLETE_GRACE_SECONDS = 20, 10
        request = submit(customer, catalog, max_tokens=50)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=ANSWER, finish_reason="stop")
        Job.objects.filter(pk=job.pk).update(last_token_at=timezone.now() - timedelta(seconds=9))
        assert services.stalled_job_end_one() is False, "inside the grace: its complete may be on the way"
        Job.objects.filter(pk=job.pk).update(last_token_at=timezone.now() - timedelta(seconds=11))
        services.request_watch(request_id=request.pk)
        assert Job.objects.get(pk=job.pk).fail_reason == "no complete within 10 seconds of its last batch"
        assert_settled_whole(request, customer, catalog, text=ANSWER, finish_reason="stop", hosts=[serving_host.host])

    def test_a_stream_that_did_not_say_it_ended_keeps_the_stall_rule(
        self, customer, serving_host, catalog, settings
    ) -> None:
        settings.STALL_SECONDS, settings.COMPLETE_GRACE_SECONDS = 20, 10
        submit(customer, catalog, max_tokens=50)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=ANSWER)
        Job.objects.filter(pk=job.pk).update(last_token_at=timezone.now() - timedelta(seconds=11))
        assert services.stalled_job_end_one() is False


class FinishReasonDoorTests:
    def test_the_socket_frame_takes_stop_or_length_and_refuses_anything_else(self) -> None:
        frame = {"type": "tokens", "job": 1, "seq": 0, "text": "Hi"}
        assert tokens_frame({**frame, "finish_reason": "length"})["finish_reason"] == "length"
        assert "finish_reason" not in tokens_frame(frame)
        with pytest.raises(DomainError) as refused:
            tokens_frame({**frame, "finish_reason": "tool_calls"})
        assert refused.value.param == "finish_reason"

    @pytest.mark.django_db(transaction=True)  # an async view: its database threads must see the rows
    def test_the_http_batch_takes_it_and_refuses_anything_else(self, customer, serving_host, catalog) -> None:
        from django.test import Client

        submit(customer, catalog)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)

        def push(body: dict) -> object:
            return Client().post(
                f"/hosts/api/jobs/{job.pk}/tokens",
                data=json.dumps(body),
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {serving_host.token}",
            )

        refused = push({"seq": 0, "text": "Hi", "finish_reason": "maybe"})
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "finish_reason")
        assert push({"seq": 0, "text": "Hi", "finish_reason": "stop"}).status_code == 200
        assert Job.objects.get(pk=job.pk).text_end == "stop"
