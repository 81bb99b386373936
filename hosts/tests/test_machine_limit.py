"""Machines per account are capped (issue 29: Sybils are not free): HOSTS_PER_ACCOUNT, raised
per owner by an operator's allowance."""

from __future__ import annotations

import uuid

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from hosts import services
from hosts.models import Host, HostAllowance

pytestmark = pytest.mark.django_db


def _owner_email() -> str:
    return f"owner-{uuid.uuid4().hex[:8]}@example.com"


class MachineLimitTests:
    def test_an_account_registers_up_to_the_limit_and_no_more(self, settings) -> None:
        settings.HOSTS_PER_ACCOUNT = 3
        email = _owner_email()
        for index in range(3):
            services.host_create(email=email, name=f"rig-{index}")
        with pytest.raises(services.MachineLimitReached, match="already has 3 machines"):
            services.host_create(email=email, name="rig-3")
        assert Host.objects.filter(owner__username=email).count() == 3

    def test_another_owner_is_not_held_by_the_first_ones_machines(self, settings) -> None:
        settings.HOSTS_PER_ACCOUNT = 1
        services.host_create(email=_owner_email(), name="rig")
        assert services.host_create(email=_owner_email(), name="rig").host.pk

    def test_an_operator_allowance_raises_the_limit_for_that_owner_only(self, settings) -> None:
        settings.HOSTS_PER_ACCOUNT = 1
        email = _owner_email()
        first = services.host_create(email=email, name="rig-0").host
        HostAllowance.objects.create(owner=first.owner, machines=2, reason="runs a small farm")
        services.host_create(email=email, name="rig-1")
        with pytest.raises(services.MachineLimitReached):
            services.host_create(email=email, name="rig-2")

    def test_the_operators_command_says_why_and_creates_nothing(self, settings) -> None:
        settings.HOSTS_PER_ACCOUNT = 1
        email = _owner_email()
        services.host_create(email=email, name="rig-0")
        with pytest.raises(CommandError, match="an operator can raise"):
            call_command("create_host", email, "rig-1")
        assert Host.objects.filter(owner__username=email).count() == 1

    def test_the_machines_page_states_the_rule_and_registers_nothing(self, settings) -> None:
        settings.HOSTS_PER_ACCOUNT = 1
        email = _owner_email()
        owner = services.host_create(email=email, name="rig-0").host.owner
        client = Client()
        client.force_login(owner)
        response = client.post("/machines/", {"name": "rig-1"})
        assert response.status_code == 200
        assert "the most machines it may register (1)" in response.content.decode()
        assert Host.objects.filter(owner=owner).count() == 1
