"""Ring stages are paid (issue 16): a ring's host share is split among its bridge and its
stage hosts by the layers each ran, in integer µ¢, the floors' remainder to the platform,
each share on its host's statement and in its ledger account."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone

from billing import selectors as ledger
from billing.models import LedgerEntry, LedgerTransaction
from billing.services import split_by_layers, split_cost
from conftest import make_host
from marketplace import selectors, services
from marketplace.models import Job, Request, StageShare
from marketplace.tests.test_services import submit
from mesh.rings.models import ModelLayout
from mesh.rings.services import StageSpec, ring_plan_create
from testkit.evidence import drawn

pytestmark = pytest.mark.django_db


def host_earned(host) -> int:
    return LedgerEntry.objects.filter(account__host=host).aggregate(total=Sum("amount_ucents"))["total"] or 0


def serve(customer, catalog, bridge, *, text: str, max_tokens: int = 40) -> Job:
    request = submit(customer, catalog, max_tokens=max_tokens, prompt_tokens=37)
    job = services.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint)
    assert job is not None and job.request_id == request.pk
    services.job_push_tokens(host=bridge.host, job_id=job.pk, seq=0, text=text)
    services.job_complete(host=bridge.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
    return Job.objects.select_related("request").get(pk=job.pk)


class SplitTests:
    def test_floors_by_layers_and_never_more_than_the_share(self) -> None:
        assert split_by_layers(1000, {1: 6, 2: 6, 3: 6}) == {1: 333, 2: 333, 3: 333}
        assert split_by_layers(7, {1: 17, 2: 1}) == {1: 6, 2: 0}
        assert split_by_layers(0, {1: 1}) == {1: 0}
        with pytest.raises(ValueError):
            split_by_layers(10, {1: 0})


class RingPayTests:
    @pytest.fixture
    def ring(self, catalog):
        n_layers = ModelLayout.objects.get(model=catalog).n_layers
        bridge, first, last = (
            make_host(name="bridge"),
            make_host(qualified=False, name="a"),
            make_host(qualified=False, name="b"),
        )
        third = n_layers // 3
        plan = ring_plan_create(
            model_name=catalog.name,
            row_width=64,
            micro_batch=2,
            bridge_host=bridge.host,
            stages=[
                StageSpec(0, third, first.host),
                StageSpec(third, n_layers - 2, None),
                StageSpec(n_layers - 2, n_layers, last.host),
            ],
        )
        return plan, bridge, first, last, {first.host.pk: third, bridge.host.pk: n_layers - 2 - third, last.host.pk: 2}

    def test_the_share_is_split_by_layers_to_the_micro_cent(self, customer, catalog, ring) -> None:
        plan, bridge, first, last, layers = ring
        job = serve(customer, catalog, bridge, text="A ring of stages answered this, every layer of it paid.")
        cost = job.request.cost_ucents
        assert cost > 0
        share = split_cost(cost).host_ucents
        expected = {host_id: share * count // plan.n_layers for host_id, count in layers.items()}
        earned = {h.host.pk: host_earned(h.host) for h in (bridge, first, last)}
        assert earned == expected
        assert job.earned_ucents == expected[bridge.host.pk]
        settlement = LedgerTransaction.objects.get(
            reference=job.request.public_id, kind=LedgerTransaction.Kind.SETTLEMENT
        )
        legs = dict(
            settlement.entries.values_list("account__kind", "amount_ucents").filter(
                account__kind__in=["platform", "customer"]
            )
        )
        assert legs["customer"] == -cost
        assert legs["platform"] == cost - sum(expected.values())  # the 20% and the floors' remainder
        assert f"ring {plan.pk}" in settlement.memo
        assert ledger.reconcile_report() == []

    def test_each_stage_host_sees_its_share_on_its_statement(self, customer, catalog, ring) -> None:
        plan, bridge, first, last, layers = ring
        job = serve(customer, catalog, bridge, text="Two answers, the second one too.")
        serve(customer, catalog, bridge, text="And another.")
        for serving in (first, last):
            lines = selectors.host_statement(host=serving.host).jobs
            assert [line["ring"] for line in lines] == [plan.pk, plan.pk]
            assert lines[1]["pk"] == job.pk and lines[1]["layers"] == f"{layers[serving.host.pk]}/{plan.n_layers}"
            assert sum(line["earned_ucents"] for line in lines) == host_earned(serving.host)
        assert StageShare.objects.filter(host=bridge.host).count() == 0, "the bridge is paid on its job line"
        assert [line["ring"] for line in selectors.host_statement(host=bridge.host).jobs] == [None, None]

    def test_an_abandoned_ring_request_pays_its_stage_hosts_as_a_completed_one_does(
        self, customer, catalog, ring
    ) -> None:
        plan, bridge, first, last, layers = ring
        request = submit(customer, catalog, max_tokens=200, prompt_tokens=37)
        job = services.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint)
        services.job_push_tokens(host=bridge.host, job_id=job.pk, seq=0, text="The ring had said this much when")
        Request.objects.filter(pk=request.pk).update(left_at=timezone.now() - timedelta(seconds=3600))
        assert services.abandoned_request_end_one() is True
        request.refresh_from_db()
        assert (request.status, request.finish_reason) == ("completed", "cancelled") and request.cost_ucents > 0
        share = split_cost(request.cost_ucents).host_ucents
        expected = {host_id: share * count // plan.n_layers for host_id, count in layers.items()}
        assert {h.host.pk: host_earned(h.host) for h in (bridge, first, last)} == expected
        assert Job.objects.get(pk=job.pk).earned_ucents == expected[bridge.host.pk]
        shares = dict(StageShare.objects.filter(job_id=job.pk).values_list("host_id", "earned_ucents"))
        assert shares == {first.host.pk: expected[first.host.pk], last.host.pk: expected[last.host.pk]}
        assert ledger.reconcile_report() == []

    def test_a_host_serving_on_its_own_machine_keeps_the_whole_share(self, customer, catalog) -> None:
        alone = make_host(name="alone")
        job = serve(customer, catalog, alone, text="No ring here.")
        assert host_earned(alone.host) == split_cost(job.request.cost_ucents).host_ucents == job.earned_ucents
        assert not StageShare.objects.exists()

    def test_a_retired_ring_pays_nobody_else(self, customer, catalog, ring) -> None:
        plan, bridge, first, _, _ = ring
        plan.status = plan.Status.RETIRED
        plan.save(update_fields=["status"])
        job = serve(customer, catalog, bridge, text="Served alone again.")
        assert host_earned(first.host) == 0
        assert host_earned(bridge.host) == split_cost(job.request.cost_ucents).host_ucents
