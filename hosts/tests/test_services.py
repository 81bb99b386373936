from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from django.db import IntegrityError
from django.utils import timezone

from core.secrets import secret_hash
from hosts import services
from hosts.models import Host
from hosts.selectors import host_by_token, host_from_secret

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


def heard_by_sockets_of(token_hash: str, action: Callable[[], object], capture: Callable) -> dict | None:
    """What a socket opened with the token of `token_hash` hears on the real channel layer
    once `action` commits (None when nothing came within a few seconds)."""
    from asgiref.sync import async_to_sync, sync_to_async
    from channels.layers import get_channel_layer

    def act() -> None:
        with capture(execute=True):
            action()

    async def listen() -> dict | None:
        layer, group = get_channel_layer(), services.host_token_group(token_hash)
        channel = await layer.new_channel()
        await layer.group_add(group, channel)
        try:
            await sync_to_async(act)()
            return await asyncio.wait_for(layer.receive(channel), timeout=5)
        except TimeoutError:
            return None
        finally:
            await layer.group_discard(group, channel)

    return async_to_sync(listen)()


class HostBanTests:
    def test_a_ban_records_reason_and_operator_and_revokes_the_token(self, serving_host) -> None:
        host = serving_host.host
        assert services.host_ban(host=host, reason="  Sold canary answers  ", by="ops") is True
        row = Host.objects.get(pk=host.pk)
        assert (row.ban_reason, row.banned_by) == ("Sold canary answers", "ops") and row.banned_at is not None
        assert row.token_hash != secret_hash(serving_host.token)
        assert host_by_token(token=serving_host.token) is None  # the old token finds nothing
        assert (row.maintenance_since, row.paused, row.token_prefix) == (
            None,
            False,
            serving_host.token[:12],
        )  # nothing else moved

    def test_a_second_ban_keeps_the_first(self, serving_host) -> None:
        services.host_ban(host=serving_host.host, reason="first", by="ops")
        stale = Host.objects.get(pk=serving_host.host.pk)
        revoked = stale.token_hash
        assert services.host_ban(host=stale, reason="second", by="other") is False
        row = Host.objects.get(pk=stale.pk)
        assert (row.ban_reason, row.banned_by, row.token_hash) == ("first", "ops", revoked)

    def test_a_ban_needs_a_reason_and_so_does_the_database(self, serving_host) -> None:
        with pytest.raises(services.BanReasonMissing):
            services.host_ban(host=serving_host.host, reason=" ", by="ops")
        assert host_by_token(token=serving_host.token) is not None
        with pytest.raises(IntegrityError):
            Host.objects.filter(pk=serving_host.host.pk).update(banned_at=timezone.now())

    def test_a_ban_leaves_a_maintenance_as_it_was(self, serving_host) -> None:
        services.host_maintenance_enter(host=serving_host.host, reason="disk full", by="automatic")
        services.host_ban(host=serving_host.host, reason="fraud", by="ops")
        row = Host.objects.get(pk=serving_host.host.pk)
        assert (row.maintenance_reason, row.maintenance_by) == ("disk full", "automatic")

    def test_the_sockets_of_the_old_token_are_told_to_close(
        self, serving_host, django_capture_on_commit_callbacks
    ) -> None:
        heard = heard_by_sockets_of(
            secret_hash(serving_host.token),
            lambda: services.host_ban(host=serving_host.host, reason="fraud", by="ops"),
            django_capture_on_commit_callbacks,
        )
        assert heard == {"type": "host.token_revoked", "code": 4403}

    def test_unban_lifts_it_once_and_the_token_stays_revoked(self, serving_host) -> None:
        host = serving_host.host
        services.host_ban(host=host, reason="fraud", by="ops")
        assert services.host_unban(host=host, by="ops") is True
        assert services.host_unban(host=host, by="ops") is False
        row = Host.objects.get(pk=host.pk)
        assert (row.banned_at, row.ban_reason, row.banned_by) == (None, "", "")
        assert host_by_token(token=serving_host.token) is None
        fresh = services.host_token_rotate(host=host)  # the owner brings it back with a new token
        assert host_from_secret(fresh.token).pk == host.pk


class HostTokenRotateTests:
    def test_the_new_token_works_and_the_old_one_does_not(self, serving_host) -> None:
        rotated = services.host_token_rotate(host=serving_host.host)
        assert rotated.token != serving_host.token and rotated.token.startswith("host-")
        assert host_by_token(token=serving_host.token) is None
        assert host_from_secret(rotated.token).pk == serving_host.host.pk
        row = Host.objects.get(pk=serving_host.host.pk)
        assert (row.token_prefix, row.token_hash) == (rotated.token[:12], secret_hash(rotated.token))

    def test_the_sockets_of_the_old_token_are_told_to_close(
        self, serving_host, django_capture_on_commit_callbacks
    ) -> None:
        heard = heard_by_sockets_of(
            secret_hash(serving_host.token),
            lambda: services.host_token_rotate(host=serving_host.host),
            django_capture_on_commit_callbacks,
        )
        assert heard == {"type": "host.token_revoked", "code": 4401}

    def test_a_banned_host_gets_no_new_token(self, serving_host) -> None:
        services.host_ban(host=serving_host.host, reason="fraud", by="ops")
        revoked = Host.objects.get(pk=serving_host.host.pk).token_hash
        with pytest.raises(services.HostBanned, match="fraud"):
            services.host_token_rotate(host=serving_host.host)
        assert Host.objects.get(pk=serving_host.host.pk).token_hash == revoked


class OwnerResumeTests:
    @pytest.mark.parametrize("by", ["operator", "verification"])
    def test_the_owner_cannot_lift_what_an_operator_or_verification_set(self, serving_host, by: str) -> None:
        services.host_maintenance_enter(host=serving_host.host, reason="held", by=by)
        assert services.owner_may_resume(Host.objects.get(pk=serving_host.host.pk)) is False
        with pytest.raises(services.MaintenanceHeld, match=by):
            services.host_maintenance_resume_by_owner(host=serving_host.host)
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_by == by

    def test_the_owner_lifts_the_reliability_rule_once(self, serving_host) -> None:
        services.host_maintenance_enter(host=serving_host.host, reason="12 jobs failed", by="automatic")
        assert services.owner_may_resume(serving_host.host) is True
        assert services.host_maintenance_resume_by_owner(host=serving_host.host) is True
        assert services.host_maintenance_resume_by_owner(host=serving_host.host) is False
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_since is None

    def test_a_page_loaded_before_the_operator_acted_lifts_nothing(self, serving_host) -> None:
        services.host_maintenance_enter(host=serving_host.host, reason="12 jobs failed", by="automatic")
        seen = Host.objects.get(pk=serving_host.host.pk)  # what the owner's page showed
        services.host_maintenance_resume(host=serving_host.host)
        services.host_maintenance_enter(host=serving_host.host, reason="stop now", by="operator")
        with pytest.raises(services.MaintenanceHeld):
            services.host_maintenance_resume_by_owner(host=seen)
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_reason == "stop now"

    def test_a_banned_host_stays_in_maintenance(self, serving_host) -> None:
        services.host_maintenance_enter(host=serving_host.host, reason="12 jobs failed", by="automatic")
        services.host_ban(host=serving_host.host, reason="fraud", by="ops")
        with pytest.raises(services.HostBanned, match="fraud"):
            services.host_maintenance_resume_by_owner(host=serving_host.host)
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_since is not None
