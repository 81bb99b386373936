"""Deliberate redundancy (issue 16): a latency-critical model with fewer than two warm hosts
gets an idle, qualified host asked to load it in its heartbeat's answer; the ask is
released (``unload``) once more hosts are warm than needed, and lapses if never honoured."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from conftest import make_customer, make_host
from hosts.models import Host
from marketplace import services
from marketplace.tests.test_services import submit
from web.selectors import pool_overview

pytestmark = pytest.mark.django_db

MODEL = "gemma-3-270m"


def beat(serving, *, loaded: list[str], active_jobs: int = 0) -> dict:
    catalog = {"installed": [MODEL], "qualified": [MODEL], "loaded": loaded, "slots": 1, "active_jobs": active_jobs}
    response = Client().post(
        "/hosts/api/heartbeat",
        data=json.dumps({"fingerprint": serving.fingerprint, "catalog": catalog}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {serving.token}",
    )
    assert response.status_code == 200, response.content
    return response.json()


def die(serving) -> None:
    """kill -9: no more heartbeats; the gateway sees it go offline."""
    Host.objects.filter(pk=serving.host.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(minutes=5), catalog_at=None
    )


@pytest.fixture
def critical(catalog):
    catalog.latency_critical = True
    catalog.save(update_fields=["latency_critical"])
    return catalog


class RedundancyTests:
    def test_killing_one_of_two_warm_hosts_warms_a_third_and_its_return_releases_it(self, critical) -> None:
        first, second, spare = make_host(name="first"), make_host(name="second"), make_host(name="spare")
        assert beat(first, loaded=[MODEL]) == {**beat(first, loaded=[MODEL]), "load": [], "unload": []}
        beat(second, loaded=[MODEL])
        assert beat(spare, loaded=[])["load"] == [], "two warm hosts: nobody is asked"

        die(first)
        assert beat(spare, loaded=[])["load"] == [MODEL]
        assert (
            pool_overview().warming[0]["host"].pk == spare.host.pk and pool_overview().warming[0]["state"] == "loading"
        )
        assert beat(spare, loaded=[])["load"] == [MODEL], "still loading: the ask stands"
        assert beat(spare, loaded=[MODEL]) == {**beat(spare, loaded=[MODEL]), "load": [], "unload": []}, "warm: kept"
        assert pool_overview().warming[0]["state"] == "warm"

        beat(first, loaded=[MODEL])  # the dead host is back: three warm, one more than needed
        assert beat(spare, loaded=[MODEL])["unload"] == [MODEL]
        assert Host.objects.get(pk=spare.host.pk).warm_asked_id is None and pool_overview().warming == []

    def test_one_missing_warm_host_asks_one_host_not_every_idle_one(self, critical) -> None:
        warm, idle_a, idle_b = make_host(name="warm"), make_host(name="a"), make_host(name="b")
        beat(warm, loaded=[MODEL])
        assert beat(idle_a, loaded=[])["load"] == [MODEL]
        assert beat(idle_b, loaded=[])["load"] == [], "one host is already loading it"

    def test_a_busy_a_paused_or_an_unqualified_host_is_never_asked(self, critical) -> None:
        busy, paused, stranger = make_host(name="busy"), make_host(name="paused"), make_host(name="x", qualified=False)
        submit(make_customer(), critical)
        assert (
            services.job_claim_next(host=busy.host, fingerprint=busy.fingerprint) is not None
        )  # busy: claimed a job cold
        assert beat(busy, loaded=[], active_jobs=1)["load"] == []
        Host.objects.filter(pk=paused.host.pk).update(paused=True)
        response = Client().post(
            "/hosts/api/heartbeat",
            data=json.dumps({"fingerprint": paused.fingerprint, "paused": True, "catalog": {"loaded": []}}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {paused.token}",
        )
        assert response.json()["load"] == []
        assert beat(stranger, loaded=[])["load"] == []

    def test_an_ask_not_honoured_in_time_lapses_and_another_host_is_asked(self, critical, settings) -> None:
        warm, slow, other = make_host(name="warm"), make_host(name="slow"), make_host(name="other")
        beat(warm, loaded=[MODEL])
        assert beat(slow, loaded=[])["load"] == [MODEL]
        assert beat(other, loaded=[])["load"] == []
        Host.objects.filter(pk=slow.host.pk).update(
            warm_asked_at=timezone.now() - timedelta(seconds=settings.WARM_ASK_SECONDS + 1)
        )
        assert beat(slow, loaded=[])["load"] == [], "it never loaded it: released"
        assert beat(other, loaded=[])["load"] == [MODEL]

    def test_a_model_that_is_not_latency_critical_asks_nobody(self, catalog) -> None:
        assert beat(make_host(name="idle"), loaded=[])["load"] == []
