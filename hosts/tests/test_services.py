from __future__ import annotations

import pytest
from django.db import IntegrityError
from django.utils import timezone

from hosts import services
from hosts.models import Host

pytestmark = pytest.mark.django_db


class HostMaintenanceTests:
    def test_it_enters_maintenance_with_a_reason_and_who_did_it(self, serving_host) -> None:
        host = serving_host.host
        assert services.host_maintenance_enter(host=host, reason="  GPU overheating  ", by="operator") is True
        row = Host.objects.get(pk=host.pk)
        assert (row.maintenance_reason, row.maintenance_by) == ("GPU overheating", "operator")
        assert row.maintenance_since is not None and host.maintenance_since == row.maintenance_since

    def test_a_second_enter_changes_nothing_and_says_so(self, serving_host) -> None:
        host = serving_host.host
        services.host_maintenance_enter(host=host, reason="first", by="operator")
        since = Host.objects.get(pk=host.pk).maintenance_since
        stale = Host.objects.get(pk=host.pk)  # someone else's copy, loaded before
        assert services.host_maintenance_enter(host=stale, reason="second", by="watchdog") is False
        row = Host.objects.get(pk=host.pk)
        assert (row.maintenance_reason, row.maintenance_by, row.maintenance_since) == ("first", "operator", since)
        assert stale.maintenance_reason == "first"  # the caller sees what is true now

    def test_it_refuses_maintenance_without_a_reason(self, serving_host) -> None:
        with pytest.raises(services.MaintenanceReasonMissing):
            services.host_maintenance_enter(host=serving_host.host, reason="   ", by="operator")
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_since is None

    def test_the_database_refuses_maintenance_without_a_reason_too(self, serving_host) -> None:
        with pytest.raises(IntegrityError):
            Host.objects.filter(pk=serving_host.host.pk).update(maintenance_since=timezone.now())

    def test_resume_clears_it_once(self, serving_host) -> None:
        host = serving_host.host
        services.host_maintenance_enter(host=host, reason="disk full", by="operator")
        assert services.host_maintenance_resume(host=host) is True
        assert services.host_maintenance_resume(host=host) is False
        row = Host.objects.get(pk=host.pk)
        assert (row.maintenance_reason, row.maintenance_since, row.maintenance_by) == ("", None, "")
