from __future__ import annotations

import pytest
from django.utils import timezone

from hosts import services
from hosts.models import Host
from marketplace import selectors

pytestmark = pytest.mark.django_db


class HostStatusTests:
    def test_maintenance_comes_after_offline_and_before_paused(self, serving_host) -> None:
        host = serving_host.host
        services.host_maintenance_enter(host=host, reason="disk full", by="operator")
        Host.objects.filter(pk=host.pk).update(paused=True)
        host.refresh_from_db()
        assert selectors.host_status(host=host) == "offline"  # never heard from
        Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now())
        host.refresh_from_db()
        assert selectors.host_status(host=host) == "maintenance"
        services.host_maintenance_resume(host=host)
        assert selectors.host_status(host=host) == "paused"
