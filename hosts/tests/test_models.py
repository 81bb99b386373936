from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from conftest import make_host
from hosts.models import Host, online_sql

pytestmark = pytest.mark.django_db


class OnlineRuleTests:
    def test_the_sql_form_selects_the_same_hosts_as_the_queryset(self) -> None:
        """`online_sql` is `Host.objects.online` for plain statements: one rule, two forms."""
        now = timezone.now()
        states = {
            "online": {"last_heartbeat_at": now},
            "silent": {"last_heartbeat_at": now - timedelta(hours=1)},
            "never": {"last_heartbeat_at": None},
            "paused": {"last_heartbeat_at": now, "paused": True},
            "maintenance": {"last_heartbeat_at": now, "maintenance_since": now, "maintenance_reason": "x"},
            "banned": {"last_heartbeat_at": now, "banned_at": now, "ban_reason": "x"},
        }
        for name, fields in states.items():
            Host.objects.filter(pk=make_host(name=name).host.pk).update(**fields)
        conditions, params = online_sql(alias="h", now=now)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT h.name FROM {Host._meta.db_table} h WHERE {conditions}", params)
            by_sql = sorted(name for (name,) in cursor.fetchall())
        assert by_sql == sorted(Host.objects.online(now).values_list("name", flat=True)) == ["online"]
