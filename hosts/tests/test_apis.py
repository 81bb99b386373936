from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from django.test import Client
from django.utils import timezone

from hosts import services
from hosts.models import Host
from marketplace.models import Job, Request

if TYPE_CHECKING:
    from testkit.personas import Customer, ServingHost

pytestmark = pytest.mark.django_db


def heartbeat(serving_host: ServingHost) -> dict:
    response = Client().post(
        "/hosts/api/heartbeat",
        data=json.dumps({"fingerprint": serving_host.fingerprint}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {serving_host.token}",
    )
    assert response.status_code == 200
    return response.json()


def me(serving_host: ServingHost) -> dict:
    response = Client().get("/hosts/api/me", HTTP_AUTHORIZATION=f"Bearer {serving_host.token}")
    assert response.status_code == 200
    return response.json()


class HostMaintenanceApiTests:
    def test_the_host_reads_its_maintenance_reason_in_me_and_in_the_heartbeat(self, serving_host) -> None:
        services.host_maintenance_enter(host=serving_host.host, reason="fan replacement", by="operator")
        assert heartbeat(serving_host) == {
            "status": "maintenance",
            "paused": False,
            "maintenance": "fan replacement",
            "load": [],
            "unload": [],
        }
        body = me(serving_host)
        assert body["status"] == "maintenance" and body["maintenance_reason"] == "fan replacement"
        assert body["maintenance_since"] is not None

    def test_me_says_maintenance_not_offline_for_a_silent_host_in_maintenance(self, serving_host) -> None:
        """A machine taken out for repairs often stops its heartbeat: it is still in maintenance."""
        services.host_maintenance_enter(host=serving_host.host, reason="fan replacement", by="operator")
        Host.objects.filter(pk=serving_host.host.pk).update(
            last_heartbeat_at=timezone.now() - timezone.timedelta(hours=1)
        )
        assert me(serving_host)["status"] == "maintenance"
        services.host_maintenance_resume(host=serving_host.host)
        assert me(serving_host)["status"] == "offline"

    def test_out_of_maintenance_both_say_null(self, serving_host) -> None:
        assert heartbeat(serving_host) == {
            "status": "online",
            "paused": False,
            "maintenance": None,
            "load": [],
            "unload": [],
        }
        body = me(serving_host)
        assert (body["maintenance_reason"], body["maintenance_since"]) == (None, None)


def call(method: str, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    client = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    if method == "get":
        response = client.get(path, **auth)
    else:
        response = client.post(path, data=json.dumps(body or {}), content_type="application/json", **auth)
    return response.status_code, (response.json() if response.content else {})


def queued_request(customer: Customer) -> Request:
    from catalog.models import CatalogModel
    from testkit.requests import submit_request

    return submit_request(customer, CatalogModel.objects.get(name="gemma-3-270m"), stream=True, seed=1, prompt_tokens=5)


@pytest.mark.django_db(transaction=True)  # the async host views run their ORM calls on their own threads
class BannedHostApiTests:
    def test_a_banned_hosts_old_token_is_refused_on_every_call_and_claims_nothing(self, serving_host, customer) -> None:
        token, fingerprint = serving_host.token, serving_host.fingerprint
        first = queued_request(customer)
        assert (
            call("post", "/hosts/api/heartbeat", token, {"fingerprint": fingerprint})[0] == 200
        )  # present, so it may claim
        status, body = call("post", "/hosts/api/claim", token, {"fingerprint": fingerprint, "wait": 0})
        assert status == 200 and body["job"]["id"] == Job.objects.get(request=first).pk  # the token worked before
        second = queued_request(customer)
        services.host_ban(host=serving_host.host, reason="Answers did not come from the model", by="ops")
        for method, path, payload in [
            ("post", "/hosts/api/heartbeat", {"fingerprint": fingerprint}),
            ("post", "/hosts/api/claim", {"fingerprint": fingerprint, "wait": 0}),
            ("post", f"/hosts/api/jobs/{body['job']['id']}/tokens", {"seq": 0, "text": "Hi"}),
            (
                "post",
                "/hosts/api/qualifications",
                {
                    "model": "gemma-3-270m",
                    "fingerprint": fingerprint,
                    "benchmark": {"prompt_tps": 1, "gen_tps": 1, "ttft_ms": 1, "memory_mb": 1},
                },
            ),
            ("get", "/hosts/api/me", None),
        ]:
            status, refused = call(method, path, token, payload)
            assert (status, refused["error"]["code"]) == (401, "invalid_host_token"), path
        assert Job.objects.get(request=second).status == Job.Status.QUEUED  # nobody took it
        assert Job.objects.get(request=first).next_seq == 0  # the push was refused

    def test_a_ban_without_a_revoked_token_is_still_refused_with_its_reason(self, serving_host) -> None:
        """A ban recorded some other way than `host_ban` (the token kept) holds too."""
        Host.objects.filter(pk=serving_host.host.pk).update(
            banned_at=timezone.now(), ban_reason="chargeback fraud", banned_by="ops"
        )
        for method, path, payload in [
            ("post", "/hosts/api/heartbeat", {"fingerprint": serving_host.fingerprint}),
            ("post", "/hosts/api/claim", {"fingerprint": serving_host.fingerprint, "wait": 0}),
        ]:
            status, refused = call(method, path, serving_host.token, payload)
            assert (status, refused["error"]["code"]) == (403, "host_banned"), path
            assert "chargeback fraud" in refused["error"]["message"]


@pytest.mark.django_db(transaction=True)
class InactiveOwnerApiTests:
    def test_an_inactive_owners_host_is_refused_until_the_account_is_active_again(self, serving_host) -> None:
        owner = serving_host.host.owner
        owner.is_active = False
        owner.save(update_fields=["is_active"])
        for method, path, payload in [
            ("post", "/hosts/api/heartbeat", {"fingerprint": serving_host.fingerprint}),
            ("post", "/hosts/api/claim", {"fingerprint": serving_host.fingerprint, "wait": 0}),
            ("get", "/hosts/api/me", None),
        ]:
            status, refused = call(method, path, serving_host.token, payload)
            assert (status, refused["error"]["code"]) == (403, "owner_inactive"), path
            assert "deactivated" in refused["error"]["message"]
        owner.is_active = True
        owner.save(update_fields=["is_active"])
        assert (
            call("post", "/hosts/api/heartbeat", serving_host.token, {"fingerprint": serving_host.fingerprint})[0]
            == 200
        )


def catalog_entry(name: str, sha256: str, **fields: object) -> object:
    """A catalog row pinning a file (what `catalog_add` writes, less what matching does not read)."""
    from catalog.models import CatalogModel

    return CatalogModel.objects.create(
        name=name,
        kind=fields.pop("kind", "chat"),
        context_length=fields.pop("context_length", 2048),
        input_price_ucents=10,
        output_price_ucents=40,
        tokenizer="bytes",
        sha256=sha256,
        **fields,
    )


class CatalogListApiTests:
    """GET /hosts/api/catalog: the files the catalog sells, for a host to match its own."""

    def test_it_lists_each_active_entry_with_the_file_it_pins(self, serving_host) -> None:
        from protocol.catalog import MODEL_FILES

        catalog_entry("tiny-chat", "ab" * 32, quantization="Q8_0", file_size=123_456, context_length=8192)
        catalog_entry("retired-chat", "cd" * 32, active=False)
        status, body = call("get", "/hosts/api/catalog", serving_host.token)
        assert status == 200
        assert [entry["name"] for entry in body["models"]] == ["all-minilm-l6-v2", "gemma-3-270m", "tiny-chat"]
        listed = {entry["name"]: entry for entry in body["models"]}
        assert listed["tiny-chat"] == {
            "name": "tiny-chat",
            "kind": "chat",
            "sha256": "ab" * 32,
            "quantization": "Q8_0",
            "file_size": 123_456,
            "context_length": 8192,
            "embedding_dimensions": None,
        }
        assert (listed["gemma-3-270m"]["sha256"], listed["gemma-3-270m"]["quantization"]) == (
            MODEL_FILES["gemma-3-270m"]["sha256"],
            "Q4_K_M",
        )
        embeddings = listed["all-minilm-l6-v2"]
        assert embeddings["kind"] == "embedding" and embeddings["embedding_dimensions"] == 384

    def test_it_answers_only_a_host_token(self, serving_host, customer) -> None:
        assert call("get", "/hosts/api/catalog", "")[0] == 401
        for token in ("not-a-token", customer.secret):
            status, refused = call("get", "/hosts/api/catalog", token)
            assert (status, refused["error"]["code"]) == (401, "invalid_host_token"), token
        Host.objects.filter(pk=serving_host.host.pk).update(
            banned_at=timezone.now(), ban_reason="cheat", banned_by="ops"
        )
        assert call("get", "/hosts/api/catalog", serving_host.token)[0] == 403

    def test_a_qualification_of_any_entry_is_held_to_that_rows_pin(self, serving_host) -> None:
        """A model mahout never shipped: the row's sha256 decides, not the shipped list."""
        catalog_entry("tiny-chat", "ab" * 32, quantization="Q8_0")
        body = {
            "model": "tiny-chat",
            "fingerprint": serving_host.fingerprint,
            "benchmark": {"prompt_tps": 1, "gen_tps": 1, "ttft_ms": 1, "memory_mb": 1},
        }
        status, refused = call("post", "/hosts/api/qualifications", serving_host.token, {**body, "sha256": "ef" * 32})
        assert (status, refused["error"]["code"]) == (409, "model_file_mismatch")
        assert "ab" * 32 in refused["error"]["message"] and "Q8_0" in refused["error"]["message"]
        assert call("post", "/hosts/api/qualifications", serving_host.token, {**body, "sha256": "ab" * 32})[0] == 201
        assert serving_host.host.qualifications.filter(model__name="tiny-chat", sha256="ab" * 32).exists()


@pytest.mark.django_db(transaction=True)
class PresenceBeforeClaimTests:
    """A claim needs a present host (a heartbeat within HOST_OFFLINE_AFTER_SECONDS) running a
    current mahout: a host that never says it is there gets no work (canaries included: they
    come through the claim)."""

    def test_a_host_that_never_heartbeats_claims_nothing(self, serving_host, customer) -> None:
        request = queued_request(customer)
        status, refused = call(
            "post", "/hosts/api/claim", serving_host.token, {"fingerprint": serving_host.fingerprint, "wait": 0}
        )
        assert (status, refused["error"]["code"]) == (409, "heartbeat_required")
        assert Job.objects.get(request=request).status == Job.Status.QUEUED
        assert (
            call("post", "/hosts/api/heartbeat", serving_host.token, {"fingerprint": serving_host.fingerprint})[0]
            == 200
        )
        status, body = call(
            "post", "/hosts/api/claim", serving_host.token, {"fingerprint": serving_host.fingerprint, "wait": 0}
        )
        assert status == 200 and body["job"]["id"] == Job.objects.get(request=request).pk

    def test_a_canary_comes_through_the_claim_not_with_the_heartbeat(self, serving_host, catalog) -> None:
        from marketplace.models import CanaryCheck, CanaryReference

        CanaryReference.objects.create(
            model=catalog,
            kind="completion",
            prompt="Once upon a time",
            max_tokens=16,
            text=" there was a cat.",
            tokens=5,
            exact_chars=17,
            gaps=[],
        )
        beat = {"fingerprint": serving_host.fingerprint}
        assert call("post", "/hosts/api/heartbeat", serving_host.token, beat)[0] == 200
        assert not CanaryCheck.objects.exists(), "a canary arrived with the heartbeat: its timing marks it"
        status, body = call(
            "post", "/hosts/api/claim", serving_host.token, {"fingerprint": serving_host.fingerprint, "wait": 0}
        )
        check = CanaryCheck.objects.get(host=serving_host.host)
        assert status == 200 and body["job"]["id"] == Job.objects.get(request=check.request).pk

    def test_a_stale_heartbeat_or_an_old_mahout_claims_nothing(self, serving_host, customer, settings) -> None:
        queued_request(customer)
        stale = timezone.now() - timezone.timedelta(seconds=settings.HOST_OFFLINE_AFTER_SECONDS + 5)
        Host.objects.filter(pk=serving_host.host.pk).update(last_heartbeat_at=stale)
        status, refused = call(
            "post", "/hosts/api/claim", serving_host.token, {"fingerprint": serving_host.fingerprint, "wait": 0}
        )
        assert (status, refused["error"]["code"]) == (409, "heartbeat_required")
        Host.objects.filter(pk=serving_host.host.pk).update(last_heartbeat_at=timezone.now(), version="0.0.1")
        status, refused = call(
            "post", "/hosts/api/claim", serving_host.token, {"fingerprint": serving_host.fingerprint, "wait": 0}
        )
        assert (status, refused["error"]["code"]) == (426, "upgrade_required")
