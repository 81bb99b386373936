"""Each host rule in `hosts.models` in all its forms — the queryset (ORM), the SQL the raw
statements of routing and claims embed, and the loaded row (Python) — over hosts in every
state: the three forms agree, and they say what the rule says."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from conftest import make_host
from hosts.models import ACCEPTING, TRUSTED, Host, claim_cap_expression, claim_cap_sql, online_sql

pytestmark = pytest.mark.django_db


@dataclass(frozen=True)
class HostState:
    name: str
    fields: Callable[[datetime], dict]  # the host's columns at `now`
    not_online: str | None  # `Host.not_online_because`: None when online
    accepting: bool  # takes work when asked (the claim's rule: the heartbeat aside)
    standing: str  # banned, probation or trusted

    def __str__(self) -> str:
        return self.name


def offline_for(now: datetime, extra: float) -> datetime:
    return now - timedelta(seconds=settings.HOST_OFFLINE_AFTER_SECONDS + extra)


MAINTENANCE = {"maintenance_since": timezone.now(), "maintenance_reason": "disk full", "maintenance_by": "operator"}
BAN = {"banned_at": timezone.now(), "ban_reason": "junk answers", "banned_by": "op"}
TRUST = {"trusted_at": timezone.now()}

STATES = [
    HostState("connected", lambda now: {"last_heartbeat_at": now}, None, True, "probation"),
    HostState(
        "heard from at the very edge", lambda now: {"last_heartbeat_at": offline_for(now, 0)}, None, True, "probation"
    ),
    HostState("stale heartbeat", lambda now: {"last_heartbeat_at": offline_for(now, 1)}, "offline", True, "probation"),
    HostState("never heard from", lambda now: {}, "offline", True, "probation"),
    HostState("paused", lambda now: {"last_heartbeat_at": now, "paused": True}, "paused", False, "probation"),
    HostState(
        "in maintenance", lambda now: {"last_heartbeat_at": now, **MAINTENANCE}, "maintenance", False, "probation"
    ),
    HostState(
        "paused in maintenance",
        lambda now: {"last_heartbeat_at": now, "paused": True, **MAINTENANCE},
        "maintenance",
        False,
        "probation",
    ),
    HostState("banned", lambda now: {"last_heartbeat_at": now, **BAN}, "banned", False, "banned"),
    HostState("banned and offline", lambda now: BAN, "banned", False, "banned"),  # (its own state outlasts a silence)
    HostState("in maintenance and offline", lambda now: MAINTENANCE, "maintenance", False, "probation"),
    HostState(
        "paused and offline",
        lambda now: {"last_heartbeat_at": offline_for(now, 60), "paused": True},
        "paused",
        False,
        "probation",
    ),
    HostState("trusted", lambda now: {"last_heartbeat_at": now, **TRUST}, None, True, "trusted"),
    HostState(
        "trusted and paused",
        lambda now: {"last_heartbeat_at": now, "paused": True, **TRUST},
        "paused",
        False,
        "trusted",
    ),
    HostState(
        "trusted and offline",
        lambda now: {"last_heartbeat_at": offline_for(now, 60), **TRUST},
        "offline",
        True,
        "trusted",
    ),
    HostState("banned and trusted", lambda now: {"last_heartbeat_at": now, **TRUST, **BAN}, "banned", False, "banned"),
    HostState(
        "banned, trusted and in maintenance",
        lambda now: {"last_heartbeat_at": now, **TRUST, **BAN, **MAINTENANCE},
        "banned",
        False,
        "banned",
    ),
]


def host_in(state: HostState, now: datetime, *, qualified: bool = False, **extra: object) -> Host:
    """A new host in `state` at `now` (`qualified`: for the shipped model, on the personas' machine)."""
    host = make_host(qualified=qualified, name=state.name).host
    Host.objects.filter(pk=host.pk).update(**state.fields(now), **extra)
    return Host.objects.get(pk=host.pk)


def by_sql(where: tuple[str, list]) -> set[int]:
    """The ids of the hosts an SQL form selects, run as a plain statement."""
    conditions, params = where
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT h.id FROM {connection.ops.quote_name(Host._meta.db_table)} h WHERE {conditions}", params
        )
        return {pk for (pk,) in cursor.fetchall()}


def ids(queryset: object) -> set[int]:
    return set(queryset.values_list("pk", flat=True))


class OnlineTests:
    @pytest.mark.parametrize("state", STATES, ids=str)
    def test_it_is_one_answer_in_the_orm_sql_and_python(self, state: HostState) -> None:
        now = timezone.now()
        host = host_in(state, now)
        expected = {host.pk} if state.not_online is None else set()
        assert ids(Host.objects.online(now)) == expected
        assert by_sql(online_sql(alias="h", now=now)) == expected
        assert ({host.pk} if host.is_online(now) else set()) == expected
        assert host.not_online_because(now) == state.not_online


class AcceptingTests:
    """The claim's rule: online but for the heartbeat (a claim is its own sign of life)."""

    @pytest.mark.parametrize("state", STATES, ids=str)
    def test_it_is_one_answer_in_the_orm_sql_and_python(self, state: HostState) -> None:
        host = host_in(state, timezone.now())
        expected = {host.pk} if state.accepting else set()
        assert ids(Host.objects.accepting()) == expected
        assert by_sql(ACCEPTING.sql(alias="h")) == expected
        assert ({host.pk} if ACCEPTING.holds(host) else set()) == expected


class TrustedTests:
    @pytest.mark.parametrize("state", STATES, ids=str)
    def test_it_is_one_answer_in_the_orm_sql_and_python(self, state: HostState) -> None:
        host = host_in(state, timezone.now())
        expected = {host.pk} if state.standing == "trusted" else set()
        assert ids(Host.objects.trusted()) == expected
        assert by_sql(TRUSTED.sql(alias="h")) == expected
        assert ({host.pk} if host.is_trusted else set()) == expected
        assert host.standing == state.standing
        assert ids(Host.objects.in_probation()) == ({host.pk} if state.standing == "probation" else set())


CAPS = [  # (state, slots, running jobs, its claim cap) with HOST_PROBATION_MAX_JOBS 2, HOST_TRUSTED_MAX_JOBS 5
    ("connected", 1, 0, 1),
    ("connected", 1, 1, 1),
    ("connected", 4, 1, 2),
    ("connected", 4, 2, 2),
    ("connected", 4, 3, 2),
    ("connected", 0, 0, 1),  # no slots (an operator's edit): one job at a time, never none
    ("connected", 0, 1, 1),
    ("trusted", 4, 3, 4),
    ("trusted", 4, 4, 4),
    ("trusted", 8, 4, 5),
    ("trusted", 8, 5, 5),
    ("trusted", 8, 6, 5),
    ("banned and trusted", 8, 1, 2),  # a ban takes trust away: the probation bound
    ("banned and trusted", 8, 2, 2),
    ("trusted and offline", 3, 2, 3),  # the cap does not ask about liveness
]


class ClaimCapTests:
    @pytest.mark.parametrize(
        ("state_name", "slots", "running", "cap"),
        CAPS,
        ids=[f"{s} {slots} slots {running} running" for s, slots, running, _ in CAPS],
    )
    def test_it_is_one_answer_in_the_orm_sql_and_python(
        self, settings, state_name: str, slots: int, running: int, cap: int
    ) -> None:
        """The cap's value in each form, and whether `running` jobs leave room for one more
        (what the claim asks: at the cap and over it, no)."""
        settings.HOST_PROBATION_MAX_JOBS, settings.HOST_TRUSTED_MAX_JOBS = 2, 5
        state = next(s for s in STATES if s.name == state_name)
        host = host_in(state, timezone.now(), slots=slots)
        expected = {host.pk} if running < cap else set()

        annotated = Host.objects.annotate(cap=claim_cap_expression())
        assert annotated.get(pk=host.pk).cap == cap
        assert ids(annotated.filter(cap__gt=running)) == expected

        cap_sql, params = claim_cap_sql(alias="h")
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {cap_sql} FROM {Host._meta.db_table} h WHERE h.id = %s", [*params, host.pk])
            assert cursor.fetchone()[0] == cap
        assert by_sql((f"%s < {cap_sql}", [running, *params])) == expected

        assert host.claim_cap == cap
        assert ({host.pk} if running < host.claim_cap else set()) == expected
