from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from hosts import services

if TYPE_CHECKING:
    from testkit.personas import ServingHost

pytestmark = pytest.mark.django_db


def heartbeat(serving_host: ServingHost) -> dict:
    response = Client().post(
        "/hosts/api/heartbeat", data=json.dumps({"fingerprint": serving_host.fingerprint}), content_type="application/json",
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
        assert heartbeat(serving_host) == {"status": "maintenance", "paused": False, "maintenance": "fan replacement"}
        body = me(serving_host)
        assert body["status"] == "maintenance" and body["maintenance_reason"] == "fan replacement"
        assert body["maintenance_since"] is not None

    def test_out_of_maintenance_both_say_null(self, serving_host) -> None:
        assert heartbeat(serving_host) == {"status": "online", "paused": False, "maintenance": None}
        body = me(serving_host)
        assert (body["maintenance_reason"], body["maintenance_since"]) == (None, None)
