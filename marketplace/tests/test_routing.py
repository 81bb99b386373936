"""Routing rules, catalogs and embeddings on the real services and views (no host processes)."""

from __future__ import annotations

import base64
import json
import struct
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.test import Client
from django.utils import timezone

from billing.models import Account
from catalog.models import CatalogModel
from conftest import make_customer, make_host
from hosts import selectors as hosts
from hosts.models import Host
from marketplace import services as market
from marketplace.models import Job, Request
from marketplace.trust import routing
from testkit.evidence import drawn
from testkit.requests import submit_request

if TYPE_CHECKING:
    from testkit.personas import Customer, ServingHost

pytestmark = pytest.mark.django_db(transaction=True)


def submit(customer: Customer, model: CatalogModel) -> Request:
    return submit_request(customer, model, max_tokens=8, prompt_tokens=3)


def beat(serving: ServingHost, *, loaded: list[str] | None, catalog: object = None, slots: int = 1) -> None:
    from hosts.services import host_heartbeat

    if catalog is None and loaded is not None:
        catalog = {
            "installed": ["gemma-3-270m"],
            "qualified": ["gemma-3-270m"],
            "loaded": loaded,
            "slots": slots,
            "active_jobs": 0,
        }
    host_heartbeat(
        host=serving.host, fingerprint=serving.fingerprint, paused=False, models_loaded=[], version="t", catalog=catalog
    )


class TestCatalogs:
    def test_a_readable_catalog_is_stored_and_a_bad_one_counts_as_unknown(self, catalog) -> None:
        serving = make_host()
        beat(serving, loaded=["gemma-3-270m"], slots=3)
        host = Host.objects.get(pk=serving.host.pk)
        assert host.catalog["loaded"] == ["gemma-3-270m"] and host.slots == 3 and host.catalog_at is not None
        for bad in ("nonsense", {"loaded": "gemma"}, {"loaded": [], "slots": 0}, {"loaded": [1]}):
            beat(serving, loaded=None, catalog=bad)
            assert Host.objects.get(pk=serving.host.pk).catalog_at is None, bad

    def test_a_stale_or_unknown_catalog_is_possibly_warm_for_every_qualified_model(self, catalog) -> None:
        serving = make_host()
        beat(serving, loaded=[])
        host = Host.objects.get(pk=serving.host.pk)
        assert hosts.warm_model_ids(host=host, model_ids=[catalog.pk]) == []
        Host.objects.filter(pk=host.pk).update(catalog_at=timezone.now() - timedelta(minutes=5))
        assert hosts.warm_model_ids(host=Host.objects.get(pk=host.pk), model_ids=[catalog.pk]) == [catalog.pk]

    def test_the_heartbeat_api_accepts_a_garbled_catalog_and_keeps_the_host_alive(self, catalog) -> None:
        serving = make_host()
        response = Client().post(
            "/hosts/api/heartbeat",
            data=json.dumps({"fingerprint": serving.fingerprint, "catalog": [1, 2]}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {serving.token}",
        )
        assert response.status_code == 200, response.content
        host = Host.objects.get(pk=serving.host.pk)
        assert host.last_heartbeat_at is not None and host.catalog_at is None


class TestOffers:
    def test_a_new_job_is_offered_to_the_warm_host_and_others_wait_for_the_offer(self, catalog) -> None:
        warm, other = make_host(name="warm"), make_host(name="other")
        beat(warm, loaded=["gemma-3-270m"])
        beat(other, loaded=[])
        request = submit(make_customer(), catalog)
        job = Job.objects.get(request=request)
        assert job.offered_host_id == warm.host.pk and job.warm_until is not None
        assert market.job_claim_next(host=other.host, fingerprint=other.fingerprint) is None
        Job.objects.filter(pk=job.pk).update(offer_until=timezone.now() - timedelta(seconds=1))
        assert market.job_claim_next(host=other.host, fingerprint=other.fingerprint) is None, "cold: inside the grace"
        Job.objects.filter(pk=job.pk).update(warm_until=timezone.now() - timedelta(seconds=1))
        assert market.job_claim_next(host=other.host, fingerprint=other.fingerprint).pk == job.pk

    def test_a_warm_host_busy_for_a_second_gets_the_job_before_an_idle_cold_host(self, catalog, settings) -> None:
        """Cold is the last resort: it waits until the busy warm host is expected to be free."""
        settings.ROUTING_COLD_GRACE_SECONDS = 2
        warm, cold = make_host(name="warm"), make_host(name="cold")
        beat(warm, loaded=["gemma-3-270m"])
        beat(cold, loaded=[])
        Host.objects.filter(pk=warm.host.pk).update(measured_tps=8.0)  # its running job: 8 tokens at 8/s = 1 s
        submit(make_customer(), catalog)
        busy = market.job_claim_next(host=warm.host, fingerprint=warm.fingerprint)
        market.job_push_tokens(host=warm.host, job_id=busy.pk, seq=0, text="Hi")
        request = submit(make_customer(), catalog)
        job = Job.objects.get(request=request)
        assert job.offered_host_id is None, "no warm host had a free slot"
        wait = (job.warm_until - job.created_at).total_seconds()
        assert 2.5 < wait < 3.1, wait  # about 1 s left on the warm host, plus the grace
        assert market.job_claim_next(host=cold.host, fingerprint=cold.fingerprint) is None
        market.job_complete(host=warm.host, job_id=busy.pk, finish_reason="stop", token_ids=drawn(busy.pk))
        assert market.job_claim_next(host=warm.host, fingerprint=warm.fingerprint).pk == job.pk

    def test_a_lapsed_offer_goes_to_the_next_host_by_the_strategy(self, catalog) -> None:
        """The strategy orders every warm claim: a job whose offer lapsed is offered again, to
        the least busy free warm host other than the one that let it lapse."""
        hosts = [make_host(name=f"w{i}") for i in range(3)]
        for serving in hosts:
            beat(serving, loaded=["gemma-3-270m"], slots=2)
        request = submit(make_customer(), catalog)
        job = Job.objects.get(request=request)
        first = job.offered_host_id
        busy = next(h for h in hosts if h.host.pk != first)  # one of the other two is running a job
        Job.objects.filter(pk=job.pk).update(offer_until=timezone.now() - timedelta(seconds=1))
        submit(make_customer(), catalog)
        other = Job.objects.exclude(pk=job.pk).get()
        Job.objects.filter(pk=other.pk).update(
            offered_host=busy.host, offer_until=timezone.now() + timedelta(seconds=60)
        )
        market.job_claim_next(host=busy.host, fingerprint=busy.fingerprint)
        market.request_watch(request_id=request.pk)
        job.refresh_from_db()
        idle = next(h for h in hosts if h.host.pk not in (first, busy.host.pk))
        assert job.offered_host_id == idle.host.pk and job.offer_until > timezone.now()
        lapsed = next(h for h in hosts if h.host.pk == first)
        assert market.job_claim_next(host=lapsed.host, fingerprint=lapsed.fingerprint) is None, "the new offer holds"
        assert market.job_claim_next(host=idle.host, fingerprint=idle.fingerprint).pk == job.pk

    def test_a_live_offer_or_a_canary_is_never_reoffered(self, catalog) -> None:
        warm = make_host(name="w")
        beat(warm, loaded=["gemma-3-270m"])
        job = Job.objects.get(request=submit(make_customer(), catalog))
        assert market.job_reoffer(job_id=job.pk) is None
        Job.objects.filter(pk=job.pk).update(offer_until=timezone.now() - timedelta(seconds=1), only_host=warm.host)
        assert market.job_reoffer(job_id=job.pk) is None

    def test_a_cold_host_takes_a_job_at_once_when_no_warm_host_is_online(self, catalog) -> None:
        cold = make_host(name="cold")
        beat(cold, loaded=[])
        job = Job.objects.get(request=submit(make_customer(), catalog))
        assert job.warm_until is None and job.offered_host_id is None
        assert market.job_claim_next(host=cold.host, fingerprint=cold.fingerprint).pk == job.pk

    def test_cold_hosts_wait_no_longer_than_the_bound_for_a_long_busy_warm_host(self, catalog, settings) -> None:
        settings.ROUTING_COLD_MAX_WAIT_SECONDS = 30
        warm = make_host(name="warm")
        beat(warm, loaded=["gemma-3-270m"])
        Host.objects.filter(pk=warm.host.pk).update(measured_tps=0.01)  # its job would take 800 s
        submit(make_customer(), catalog)
        market.job_claim_next(host=warm.host, fingerprint=warm.fingerprint)
        job = Job.objects.get(request=submit(make_customer(), catalog))
        assert (job.warm_until - job.created_at).total_seconds() == pytest.approx(30, abs=0.5)

    def test_no_offer_goes_to_a_full_paused_offline_or_resting_host(self, catalog) -> None:
        pool = [make_host(name=f"h{i}") for i in range(4)]
        for serving in pool:
            beat(serving, loaded=["gemma-3-270m"])
        Host.objects.filter(pk=pool[0].host.pk).update(paused=True)
        Host.objects.filter(pk=pool[1].host.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
        Host.objects.filter(pk=pool[2].host.pk).update(maintenance_since=timezone.now(), maintenance_reason="x")
        customer = make_customer()
        first = Job.objects.get(request=submit(customer, catalog))
        assert first.offered_host_id == pool[3].host.pk
        second = Job.objects.get(request=submit(customer, catalog))  # pool[3] has one slot, already offered
        assert second.offered_host_id is None

    def test_least_connections_offers_to_the_least_busy(self, catalog) -> None:
        hosts = [make_host(name=f"lc{i}") for i in range(3)]
        for serving in hosts:
            beat(serving, loaded=["gemma-3-270m"], slots=5)
        customer = make_customer()
        for _ in range(9):
            job = Job.objects.get(request=submit(customer, catalog))
            owner = next(s for s in hosts if s.host.pk == job.offered_host_id)
            assert market.job_claim_next(host=owner.host, fingerprint=owner.fingerprint).pk == job.pk
        counts = [Job.objects.filter(host=s.host, status=Job.Status.RUNNING).count() for s in hosts]
        assert counts == [3, 3, 3]

    def test_least_connections_weighs_a_hosts_load_by_its_slots(self, catalog) -> None:
        wide, narrow = make_host(name="eight-slots"), make_host(name="two-slots")
        beat(wide, loaded=["gemma-3-270m"], slots=8)
        beat(narrow, loaded=["gemma-3-270m"], slots=2)
        Host.objects.filter(pk__in=[wide.host.pk, narrow.host.pk]).update(
            trusted_at=timezone.now()
        )  # every slot usable
        customer = make_customer()
        for serving in (wide, narrow):  # one job running on each
            job = Job.objects.get(request=submit(customer, catalog))
            Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, host=serving.host, offered_host=None)
        offered = [Job.objects.get(request=submit(customer, catalog)).offered_host_id for _ in range(3)]
        assert offered == [wide.host.pk] * 3, "1 of 8 slots taken is less busy than 1 of 2"

    def test_an_n_requests_later_choices_go_beside_the_first_while_its_host_has_a_free_slot(self, catalog) -> None:
        first_host, other = make_host(name="beside"), make_host(name="elsewhere")
        for serving in (first_host, other):
            beat(serving, loaded=["gemma-3-270m"], slots=3)
        customer = make_customer()
        first = submit(customer, catalog)
        assert Job.objects.get(request=first).offered_host_id in (first_host.host.pk, other.host.pk)
        where = Job.objects.get(request=first).offered_host_id
        later = [
            submit_request(customer, catalog, max_tokens=8, prompt_tokens=3, choice_of=first.public_id)
            for _ in range(3)
        ]
        offered = [Job.objects.get(request=row).offered_host_id for row in later]
        elsewhere = other.host.pk if where == first_host.host.pk else first_host.host.pk
        assert offered == [where, where, elsewhere], (
            "the prompt read once where it has room; then the strategy's choice"
        )

    def test_a_hosts_load_is_its_running_jobs_and_live_offers(self, catalog) -> None:
        busy, idle = make_host(name="busy"), make_host(name="idle")
        for serving in (busy, idle):
            beat(serving, loaded=["gemma-3-270m"], slots=10)
        customer = make_customer()
        jobs = [Job.objects.get(request=submit(customer, catalog)) for _ in range(4)]
        now = timezone.now()
        Job.objects.filter(pk=jobs[0].pk).update(status=Job.Status.RUNNING, host=busy.host)
        Job.objects.filter(pk=jobs[1].pk).update(offered_host=busy.host, offer_until=now + timedelta(seconds=30))
        Job.objects.filter(pk=jobs[2].pk).update(
            offered_host=busy.host, offer_until=now - timedelta(seconds=1)
        )  # lapsed
        Job.objects.filter(pk=jobs[3].pk).update(offered_host=None, offer_until=None)
        load = {c.host_id: c.active for c in routing.candidates(model=catalog, now=now)}
        assert load == {busy.host.pk: 2, idle.host.pk: 0}

    def test_weighted_offers_follow_the_weights(self, catalog) -> None:
        CatalogModel.objects.filter(pk=catalog.pk).update(routing_strategy="weighted")
        catalog.refresh_from_db()
        big, small = make_host(name="big"), make_host(name="small")
        for serving in (big, small):
            beat(serving, loaded=["gemma-3-270m"], slots=64)
        Host.objects.filter(pk__in=[big.host.pk, small.host.pk]).update(
            trusted_at=timezone.now()
        )  # all 64 slots usable
        Host.objects.filter(pk=big.host.pk).update(routing_weight=3.0)  # operators override the measured 40 tok/s
        Host.objects.filter(pk=small.host.pk).update(routing_weight=1.0)
        customer = make_customer(credit_ucents=10**11)
        offered = [Job.objects.get(request=submit(customer, catalog)).offered_host_id for _ in range(40)]
        assert 29 <= offered.count(big.host.pk) <= 31, offered.count(big.host.pk)

    def test_a_host_that_fails_too_often_rests_with_a_reason(self, catalog, settings) -> None:
        settings.HOST_MAX_FAILURES_PER_HOUR = 2
        flaky = make_host(name="flaky")
        customer = make_customer()
        for n in range(3):
            submit(customer, catalog)
            job = market.job_claim_next(host=flaky.host, fingerprint=flaky.fingerprint)
            assert job is not None, n
            market.job_fail(host=flaky.host, job_id=job.pk, reason="boom")
            Job.objects.filter(status=Job.Status.QUEUED).update(status=Job.Status.FAILED)  # drop the continuations
        host = Host.objects.get(pk=flaky.host.pk)
        assert host.maintenance_since is not None and "3 jobs" in host.maintenance_reason
        submit(customer, catalog)
        assert market.job_claim_next(host=host, fingerprint=flaky.fingerprint) is None


class TestModelList:
    def test_it_lists_only_served_models_with_warm_counts_and_needs_a_key(self, catalog, customer) -> None:
        client = Client()
        assert client.get("/v1/models").status_code == 401
        auth = {"HTTP_AUTHORIZATION": f"Bearer {customer.secret}"}
        assert client.get("/v1/models", **auth).json()["data"] == []
        from django.core.cache import cache

        warm, cold = make_host(name="w"), make_host(name="c")
        beat(warm, loaded=["gemma-3-270m"])
        beat(cold, loaded=[])
        cache.clear()
        data = client.get("/v1/models", **auth).json()["data"]
        assert [(m["id"], m["hosts_online"], m["hosts_warm"]) for m in data] == [("gemma-3-270m", 2, 1)]


class TestEmbeddings:
    @pytest.fixture
    def minilm(self, catalog: CatalogModel) -> CatalogModel:
        return CatalogModel.objects.get(name="all-minilm-l6-v2")

    def embed_host(self, model: CatalogModel) -> ServingHost:
        from hosts.services import qualification_register

        serving = make_host(qualified=False, name="embedder")
        qualification_register(
            host=serving.host,
            model_name=model.name,
            fingerprint=serving.fingerprint,
            benchmark={"prompt_tps": 900, "gen_tps": 900, "ttft_ms": 5, "memory_mb": 90},
            machine={},
            sha256=model.sha256,
        )
        return serving

    def test_a_host_completes_with_vectors_and_the_input_tokens_are_billed(self, minilm) -> None:
        customer = make_customer()
        serving = self.embed_host(minilm)
        CatalogModel.objects.filter(pk=minilm.pk).update(embedding_dimensions=2)  # short vectors, for the test
        request = submit_request(customer, minilm, kind="embeddings", max_tokens=0, prompt_tokens=7, inputs=["a", "b"])
        payload = market.job_claim_payload(host=serving.host, model_ids=[minilm.pk])
        job = Job.objects.select_related("request", "model").get(pk=payload["id"])
        assert payload == market.job_payload(job), "the long-poll's payload is the stored job's"
        assert payload["kind"] == "embeddings" and payload["input"] == ["a", "b"]
        with pytest.raises(market.BadResult):
            market.job_complete(host=serving.host, job_id=job.pk, finish_reason="stop", embeddings=[[0.1, 0.2]])
        with pytest.raises(market.BadResult):
            market.job_complete(
                host=serving.host, job_id=job.pk, finish_reason="stop", embeddings=[[0.1], [float("nan")]]
            )
        with pytest.raises(market.BadResult):  # an integer no float can hold (JSON allows it), not a 500
            market.job_complete(host=serving.host, job_id=job.pk, finish_reason="stop", embeddings=[[0.1], [10**400]])
        done = market.job_complete(
            host=serving.host, job_id=job.pk, finish_reason="stop", embeddings=[[0.6, 0.8], [1, 0]]
        )
        row = Request.objects.get(pk=request.pk)
        assert row.status == "completed" and row.result == [[0.6, 0.8], [1.0, 0.0]] and row.inputs is None
        assert row.cost_ucents == 7 * minilm.input_price_ucents and done.earned_ucents == row.cost_ucents * 80 // 100
        host_account = Account.objects.get(kind="host", host=serving.host)
        assert host_account.balance_ucents == done.earned_ucents

    def test_a_chat_job_cannot_complete_with_vectors(self, catalog, serving_host) -> None:
        submit(make_customer(), catalog)
        job = market.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        with pytest.raises(market.BadResult):
            market.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", embeddings=[[1.0]])

    @pytest.mark.parametrize(
        "body, status, code",
        [
            ({"model": "all-minilm-l6-v2", "input": ""}, 400, "invalid_value"),
            ({"model": "all-minilm-l6-v2", "input": []}, 400, "invalid_value"),
            ({"model": "all-minilm-l6-v2", "input": [1, 2, 3]}, 400, "invalid_value"),
            ({"model": "all-minilm-l6-v2", "input": "hi", "dimensions": 64}, 400, "invalid_value"),
            ({"model": "all-minilm-l6-v2", "input": "hi", "encoding_format": "hex"}, 400, "invalid_value"),
            ({"model": "all-minilm-l6-v2", "input": "word " * 300}, 400, "context_length_exceeded"),
            ({"model": "gemma-3-270m", "input": "hi"}, 400, "wrong_model_kind"),
            ({"model": "nope", "input": "hi"}, 404, "model_not_found"),
        ],
    )
    def test_bad_embedding_requests_get_clear_errors_and_hold_nothing(
        self, minilm, customer, body, status, code
    ) -> None:
        response = Client().post(
            "/v1/embeddings",
            data=json.dumps(body),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
        )
        assert response.status_code == status, response.content
        assert response.json()["error"]["code"] == code
        assert not Request.objects.exists()

    def test_base64_encoding_is_little_endian_float32(self) -> None:
        from marketplace.openai.apis import embeddings_body

        row = Request(public_id="emb-x", prompt_tokens=2, result=[[0.5, -1.0]])
        row.model = CatalogModel(name="m")
        encoded = embeddings_body(row, encoding="base64")["data"][0]["embedding"]
        assert struct.unpack("<2f", base64.b64decode(encoded)) == (0.5, -1.0)


class TestRedundancy:
    def test_the_admin_and_the_host_dashboard_warn_about_a_latency_critical_model_on_one_warm_host(
        self, catalog
    ) -> None:
        from django.contrib.auth import get_user_model

        CatalogModel.objects.filter(pk=catalog.pk).update(latency_critical=True)
        serving = make_host(name="only-one")
        beat(serving, loaded=["gemma-3-270m"])
        assert [(m.name, warm) for m, warm in hosts.under_redundant_models()] == [("gemma-3-270m", 1)]

        operator = get_user_model().objects.create_superuser("op@example.com", "op@example.com", "pw-12345678")
        admin = Client()
        admin.force_login(operator)
        page = admin.get("/admin/catalog/catalogmodel/").content.decode()
        assert "Latency-critical model gemma-3-270m has 1 warm host(s)" in page
        owner = Client()
        owner.force_login(serving.host.owner)
        page = owner.get("/machines/").content.decode()
        assert "gemma-3-270m is latency-critical but only 1 machine" in page

        second = make_host(name="second")
        beat(second, loaded=["gemma-3-270m"])
        assert hosts.under_redundant_models() == []
        assert "latency-critical" not in owner.get("/machines/").content.decode()
