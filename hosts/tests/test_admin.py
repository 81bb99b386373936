"""The host admin through the real admin: an operator logged in as a superuser
posts the changelist's actions."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.test import Client

from conftest import make_host
from hosts import services
from hosts.models import Host

if TYPE_CHECKING:
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/hosts/host/"


@pytest.fixture
def operator() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-long-enough"))
    return client


def act(client: Client, action: str, hosts: list[Host]) -> TestResponse:
    return client.post(CHANGELIST, {"action": action, "_selected_action": [h.pk for h in hosts], "index": "0"})


def apply_reason(client: Client, hosts: list[Host], reason: str) -> TestResponse:
    """The second step: the reason form posted back to the changelist."""
    return client.post(
        CHANGELIST,
        {
            "action": "maintenance_enter",
            "_selected_action": [h.pk for h in hosts],
            "reason": reason,
            "apply": "Put in maintenance",
        },
    )


class HostMaintenanceActionTests:
    def test_put_in_maintenance_asks_for_a_reason_first(self, operator, serving_host) -> None:
        response = act(operator, "maintenance_enter", [serving_host.host])
        assert response.status_code == 200
        page = response.content.decode()
        assert "Put hosts in maintenance" in page and 'name="reason"' in page and serving_host.host.name in page
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_since is None

    def test_the_reason_form_puts_every_selected_host_in_maintenance(self, operator, serving_host, outsider) -> None:
        third = make_host(name="third").host
        selected = [serving_host.host, outsider.host]
        response = apply_reason(operator, selected, "PSU recall: please swap the power supply")
        assert response.status_code == 302
        for host in selected:
            row = Host.objects.get(pk=host.pk)
            assert row.maintenance_reason == "PSU recall: please swap the power supply"
            assert row.maintenance_by == "operator" and row.maintenance_since is not None
        assert Host.objects.get(pk=third.pk).maintenance_since is None
        assert "2 host(s) put in maintenance" in operator.get(response["Location"]).content.decode()

    def test_an_empty_reason_shows_the_form_again(self, operator, serving_host) -> None:
        response = apply_reason(operator, [serving_host.host], " ")
        assert response.status_code == 200 and "This field is required" in response.content.decode()
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_since is None

    def test_a_host_already_in_maintenance_keeps_its_reason(self, operator, serving_host) -> None:
        services.host_maintenance_enter(host=serving_host.host, reason="first reason", by="watchdog")
        apply_reason(operator, [serving_host.host], "second")
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_reason == "first reason"

    def test_resume_takes_the_selected_hosts_out_of_maintenance(self, operator, serving_host, outsider) -> None:
        for host in (serving_host.host, outsider.host):
            services.host_maintenance_enter(host=host, reason="disk full", by="operator")
        response = act(operator, "maintenance_resume", [serving_host.host])
        assert response.status_code == 302
        assert Host.objects.get(pk=serving_host.host.pk).maintenance_since is None
        assert Host.objects.get(pk=outsider.host.pk).maintenance_since is not None


class HostChangelistTests:
    def test_it_lists_status_reason_and_models_loaded_and_filters_by_maintenance(
        self, operator, serving_host, outsider
    ) -> None:
        Host.objects.filter(pk=outsider.host.pk).update(models_loaded=["gemma-3-270m"])
        services.host_maintenance_enter(host=serving_host.host, reason="thermal paste", by="operator")
        page = operator.get(CHANGELIST).content.decode()
        assert "thermal paste" in page and "gemma-3-270m" in page
        assert '<td class="field-status">offline</td>' in page
        in_maintenance = operator.get(CHANGELIST + "?maintenance=yes").content.decode()
        assert "thermal paste" in in_maintenance and outsider.host.name not in in_maintenance
        assert operator.get(CHANGELIST + "?connection=online").status_code == 200

    def test_the_change_page_never_shows_the_token_hash(self, operator, serving_host) -> None:
        page = operator.get(f"{CHANGELIST}{serving_host.host.pk}/change/").content.decode()
        assert serving_host.host.token_prefix in page
        assert serving_host.host.token_hash not in page and serving_host.token not in page


def apply_ban(client: Client, hosts: list[Host], reason: str) -> TestResponse:
    return client.post(
        CHANGELIST, {"action": "ban", "_selected_action": [h.pk for h in hosts], "reason": reason, "apply": "Ban"}
    )


def heartbeat_status(token: str, fingerprint: str) -> int:
    return (
        Client()
        .post(
            "/hosts/api/heartbeat",
            data=json.dumps({"fingerprint": fingerprint}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )
        .status_code
    )


class HostBanActionTests:
    def test_ban_asks_for_a_reason_first(self, operator, serving_host) -> None:
        response = act(operator, "ban", [serving_host.host])
        page = response.content.decode()
        assert (
            response.status_code == 200
            and "Ban hosts" in page
            and 'name="reason"' in page
            and serving_host.host.name in page
        )
        assert Host.objects.get(pk=serving_host.host.pk).banned_at is None

    def test_the_reason_form_bans_revokes_the_token_and_writes_the_history(
        self, operator, serving_host, outsider
    ) -> None:
        assert heartbeat_status(serving_host.token, serving_host.fingerprint) == 200
        response = apply_ban(operator, [serving_host.host], "Canary answers were not the model's")
        assert response.status_code == 302
        row = Host.objects.get(pk=serving_host.host.pk)
        assert (row.ban_reason, row.banned_by) == ("Canary answers were not the model's", "ops") and row.banned_at
        assert heartbeat_status(serving_host.token, serving_host.fingerprint) == 401
        assert heartbeat_status(outsider.token, outsider.fingerprint) == 200  # only the selected host
        (entry,) = LogEntry.objects.filter(object_id=str(row.pk))
        assert entry.user.username == "ops" and "Canary answers were not the model's" in entry.get_change_message()
        page = operator.get(response["Location"]).content.decode()
        assert "1 host(s) banned" in page and "banned: Canary answers" in page

    def test_an_empty_reason_bans_nobody(self, operator, serving_host) -> None:
        response = apply_ban(operator, [serving_host.host], "  ")
        assert response.status_code == 200 and "This field is required" in response.content.decode()
        assert heartbeat_status(serving_host.token, serving_host.fingerprint) == 200

    def test_a_banned_host_keeps_its_first_ban(self, operator, serving_host) -> None:
        services.host_ban(host=serving_host.host, reason="first", by="alice")
        response = apply_ban(operator, [serving_host.host], "second")
        assert "already banned" in operator.get(response["Location"]).content.decode()
        assert Host.objects.get(pk=serving_host.host.pk).ban_reason == "first"

    def test_lifting_the_ban_leaves_the_token_revoked(self, operator, serving_host) -> None:
        services.host_ban(host=serving_host.host, reason="mistake", by="ops")
        response = act(operator, "unban", [serving_host.host])
        assert response.status_code == 302
        assert Host.objects.get(pk=serving_host.host.pk).banned_at is None
        assert (
            heartbeat_status(serving_host.token, serving_host.fingerprint) == 401
        )  # the owner rotates it to come back
        assert "rotate" in operator.get(response["Location"]).content.decode()

    def test_the_trust_filter_and_the_ban_fields_are_read_only(self, operator, serving_host, outsider) -> None:
        services.host_ban(host=serving_host.host, reason="fraud", by="ops")

        def link(host: Host) -> str:
            return f'href="{CHANGELIST}{host.pk}/change/'

        banned = operator.get(CHANGELIST + "?trust=banned").content.decode()
        assert link(serving_host.host) in banned and link(outsider.host) not in banned
        probation = operator.get(CHANGELIST + "?trust=probation").content.decode()
        assert link(outsider.host) in probation and link(serving_host.host) not in probation
        change = operator.get(f"{CHANGELIST}{serving_host.host.pk}/change/").content.decode()
        assert "fraud" in change and 'name="ban_reason"' not in change and 'name="banned_at"' not in change
