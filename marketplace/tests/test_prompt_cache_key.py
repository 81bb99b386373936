"""The key a host reuses held prompts under (issue 53's privacy rule): one per account and host,
given only to the host that claims the job, never in an audit's copy of the payload."""

from __future__ import annotations

import pytest

from conftest import make_customer, make_host
from marketplace import services
from marketplace.lifecycle.claims import prompt_cache_key
from testkit.requests import submit_request

pytestmark = pytest.mark.django_db(transaction=True)


def _claimed(customer, catalog, host) -> dict:  # noqa: ANN001
    submit_request(customer, catalog)
    payload = services.job_claim_payload(host=host.host, model_ids=[catalog.pk])
    assert payload is not None
    services.job_fail(host=host.host, job_id=payload["id"], reason="only the payload was wanted", cause="request")
    return payload


def test_a_claimed_job_carries_its_accounts_key_on_that_host_and_no_other(catalog, serving_host) -> None:  # noqa: ANN001
    ann, bob = make_customer(), make_customer()
    other = make_host(name="other-rig")
    keys = [_claimed(ann, catalog, serving_host)["cache_key"], _claimed(ann, catalog, serving_host)["cache_key"]]
    assert keys[0] == keys[1], "one account's jobs on one host share a key"
    assert _claimed(bob, catalog, serving_host)["cache_key"] != keys[0], "another account's do not"
    assert prompt_cache_key(user_id=ann.user.pk, host_id=other.host.pk) != keys[0], "nor another host's"
    assert len(keys[0]) == 32 and int(keys[0], 16) >= 0, "an opaque keyed hash"


def test_the_payload_an_audit_keeps_has_no_key(catalog, serving_host) -> None:  # noqa: ANN001
    from marketplace.lifecycle.claims import job_payload
    from marketplace.models import Job

    _claimed(make_customer(), catalog, serving_host)
    assert "cache_key" not in job_payload(Job.objects.select_related("request", "model").latest("pk"))
