"""The host rules of `hosts.models` where the marketplace applies them: the status a host
is shown and the claim's statement, over hosts in every state
(`hosts/tests/test_predicates.py` holds the rules' own forms to one answer)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from conftest import make_host
from hosts.models import ACCEPTING, Host
from hosts.tests.test_predicates import STATES, HostState, host_in
from marketplace import selectors, services
from marketplace.models import Job
from marketplace.tests.test_services import submit

pytestmark = pytest.mark.django_db

# `host_status` reads its own clock: a heartbeat at the very edge is past it by then
AWAY_FROM_THE_EDGE = [state for state in STATES if state.name != "heard from at the very edge"]


class HostStatusTests:
    @pytest.mark.parametrize("state", AWAY_FROM_THE_EDGE, ids=str)
    def test_it_is_online_by_the_one_rule_and_else_names_what_it_fails(self, state: HostState) -> None:
        host = host_in(state, timezone.now())
        assert selectors.host_status(host=host) == (state.not_online or "online")
        annotated = selectors.with_running_job(Host.objects.filter(pk=host.pk)).get()
        assert selectors.host_status(host=annotated) == (state.not_online or "online")

    @pytest.mark.parametrize("banned", [False, True])
    def test_a_host_running_a_job_is_busy_unless_banned(self, customer, catalog, banned: bool) -> None:
        serving = make_host()
        Host.objects.filter(pk=serving.host.pk).update(last_heartbeat_at=timezone.now())
        assert services.job_claim_next(host=serving.host, fingerprint=serving.fingerprint) is None
        submit(customer, catalog)
        assert services.job_claim_next(host=serving.host, fingerprint=serving.fingerprint) is not None
        if banned:
            Host.objects.filter(pk=serving.host.pk).update(banned_at=timezone.now(), ban_reason="junk", banned_by="op")
        serving.host.refresh_from_db()
        assert selectors.host_status(host=serving.host) == ("banned" if banned else "busy")


class ClaimRuleTests:
    @pytest.mark.parametrize("trusted_only", [False, True], ids=["any host", "trusted only"])
    @pytest.mark.parametrize("state", STATES, ids=str)
    def test_the_claim_takes_a_job_exactly_when_the_rules_say(
        self, customer, catalog, state: HostState, trusted_only: bool
    ) -> None:
        """Accepting work (the heartbeat aside: a claim is its own sign of life), and trusted
        when the job asks for trusted hosts."""
        host = host_in(state, timezone.now(), qualified=True)
        submit(customer, catalog)
        Job.objects.update(trusted_only=trusted_only)
        expected = state.accepting and (not trusted_only or state.standing == "trusted")
        assert (ACCEPTING.holds(host) and (not trusted_only or host.is_trusted)) is expected
        claimed = services.job_claim_next(host=host, fingerprint="f" * 64)
        assert (claimed is not None) is expected

    CAPS = [  # (trusted, slots, running jobs) with HOST_PROBATION_MAX_JOBS 2, HOST_TRUSTED_MAX_JOBS 5
        (False, 1, 0),
        (False, 1, 1),
        (False, 4, 1),
        (False, 4, 2),
        (False, 4, 3),
        (False, 0, 0),
        (False, 0, 1),
        (True, 4, 3),
        (True, 4, 4),
        (True, 8, 4),
        (True, 8, 5),
        (True, 8, 6),
    ]

    @pytest.mark.parametrize(
        ("trusted", "slots", "running"),
        CAPS,
        ids=[f"{'trusted' if t else 'probation'} {s} slots {r} running" for t, s, r in CAPS],
    )
    def test_the_claim_stops_at_the_claim_cap(
        self, settings, customer, catalog, trusted: bool, slots: int, running: int
    ) -> None:
        settings.HOST_PROBATION_MAX_JOBS, settings.HOST_TRUSTED_MAX_JOBS = 2, 5
        serving = make_host(trusted=trusted)
        Host.objects.filter(pk=serving.host.pk).update(last_heartbeat_at=timezone.now(), slots=slots)
        serving.host.refresh_from_db()
        for _ in range(running):
            Job.objects.filter(pk=submit(customer, catalog).jobs.get().pk).update(
                status=Job.Status.RUNNING, host=serving.host, claimed_at=timezone.now()
            )
        submit(customer, catalog)
        claimed = services.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)
        assert (claimed is not None) is (running < serving.host.claim_cap)
