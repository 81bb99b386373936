from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from conftest import make_customer
from hosts.models import Host
from marketplace.models import Job
from web import selectors
from web.tests.factories import finished_request

pytestmark = pytest.mark.django_db


class PoolOverviewTests:
    def test_it_counts_hosts_jobs_failures_and_continuations(self, catalog, serving_host, outsider) -> None:
        now = timezone.now()
        Host.objects.filter(pk=serving_host.host.pk).update(last_heartbeat_at=now)
        Host.objects.filter(pk=outsider.host.pk).update(last_heartbeat_at=now, paused=True)
        customer = make_customer()
        failed = finished_request(customer=customer, failed=True)
        Job.objects.create(request=failed, model=failed.model, attempt=2, status=Job.Status.FAILED, finished_at=now)
        old = finished_request(customer=customer, failed=True)
        Job.objects.filter(request=old).update(finished_at=now - timedelta(hours=2))
        pool = selectors.pool_overview()
        assert (pool.hosts_total, pool.hosts_online, pool.hosts_paused, pool.hosts_busy) == (2, 1, 1, 0)
        assert pool.failures_last_hour == 2  # the old failure is outside the hour
        assert pool.continuations_last_hour == 1

    def test_it_counts_maintenance_apart_and_warm_hosts_per_model(self, catalog, serving_host, outsider) -> None:
        from conftest import make_host
        from hosts.services import host_maintenance_enter

        third = make_host(name="third").host
        now = timezone.now()
        Host.objects.filter(pk__in=[serving_host.host.pk, outsider.host.pk, third.pk]).update(
            last_heartbeat_at=now, models_loaded=["gemma-3-270m"]
        )
        Host.objects.filter(pk=third.pk).update(paused=True)
        host_maintenance_enter(host=outsider.host, reason="bad RAM", by="operator")
        pool = selectors.pool_overview()
        assert (pool.hosts_online, pool.hosts_paused, pool.hosts_maintenance) == (1, 1, 1)
        assert [h.name for h in pool.in_maintenance] == ["outsider"]
        (gemma,) = [m for m in pool.models if m.name == "gemma-3-270m"]
        assert (gemma.warm, gemma.qualified_online) == (1, 1)  # the paused and the maintained host do not count


class PoolTrustTests:
    def test_trust_counts_put_a_banned_host_apart_even_if_it_was_trusted(self, catalog, serving_host, outsider) -> None:
        from hosts.services import host_ban

        Host.objects.filter(pk__in=[serving_host.host.pk, outsider.host.pk]).update(trusted_at=timezone.now())
        host_ban(host=outsider.host, reason="fraud", by="ops")
        pool = selectors.pool_overview()
        assert (pool.hosts_probation, pool.hosts_trusted, pool.hosts_banned) == (0, 1, 1)
        assert [host.name for host in pool.banned] == ["outsider"]

    def test_failed_verification_lists_each_host_once_with_its_latest_reason(
        self, catalog, serving_host, outsider
    ) -> None:
        from web.tests.factories import canary_checked

        canary_checked(host=serving_host.host, verdict="failed", reason="older")
        canary_checked(host=serving_host.host, verdict="failed", reason="newer")
        canary_checked(host=outsider.host, verdict="passed")
        (row,) = selectors.verification_failures()
        assert (row["host__name"], row["failures"], row["last_reason"]) == ("rig", 2, "newer")


class HostEarningsDailyTests:
    def test_it_has_a_row_for_every_day_and_only_this_hosts_jobs(self, catalog, serving_host, outsider) -> None:
        customer = make_customer()
        finished_request(customer=customer, host=serving_host.host, cost_ucents=1_000)
        finished_request(customer=customer, host=serving_host.host, cost_ucents=2_000)
        finished_request(customer=customer, host=outsider.host, cost_ucents=5_000)
        today = timezone.now().date()
        rows = selectors.host_earnings_daily(host=serving_host.host, start=today - timedelta(days=6), end=today)
        assert len(rows) == 7 and rows[-1] == {"day": today, "jobs": 2, "earned_ucents": 800 + 1_600}
        assert all(row["earned_ucents"] == 0 for row in rows[:-1])


class CustomerBalanceTests:
    def test_it_is_zero_before_the_first_credit(self, catalog) -> None:
        balance = selectors.customer_balance(user=make_customer(credit_ucents=0).user)
        assert (balance.balance_ucents, balance.held_ucents, balance.available_ucents) == (0, 0, 0)
