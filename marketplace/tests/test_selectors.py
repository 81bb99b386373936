from __future__ import annotations

import pytest
from django.utils import timezone

from hosts import services
from hosts.models import Host
from marketplace import selectors

pytestmark = pytest.mark.django_db


class HostStatusTests:
    def test_maintenance_comes_before_paused_and_paused_before_offline(self, serving_host) -> None:
        """A host's own state outlasts a silence (issue 30: a silent host in maintenance was "offline")."""
        host = serving_host.host
        services.host_maintenance_enter(host=host, reason="disk full", by="operator")
        Host.objects.filter(pk=host.pk).update(paused=True)
        host.refresh_from_db()
        assert selectors.host_status(host=host) == "maintenance"  # never heard from
        services.host_maintenance_resume(host=host)
        host.refresh_from_db()
        assert selectors.host_status(host=host) == "paused"
        Host.objects.filter(pk=host.pk).update(paused=False)
        host.refresh_from_db()
        assert selectors.host_status(host=host) == "offline"
        Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now())
        host.refresh_from_db()
        assert selectors.host_status(host=host) == "online"
