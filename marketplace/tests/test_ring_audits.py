"""A ring's final text is audited like any job's (issue 29): its stages draw by the specified
sampler (mahout/tests/test_ring_audit.py: the llama.cpp verifier passes an honest ring's
answers), so the gateway draws ring jobs for audits too. Every host's share of an audited
ring job waits in the escrow (its stage hosts' with its bridge's); a pass pays each its
layers' share, a failure refunds the customer all of it and opens an inquiry into whose fault
it was (test_ring_inquiries.py); a ring all on its bridge's host blames that host. A job at
top_p < 1 is drawn too (mahout 0.5.0's rings draw the nucleus by the specified sampler); a ring
that reports no tokens is drawn and fails, as any host does."""

from __future__ import annotations

import pytest

from billing import selectors as ledger
from billing.models import Account
from billing.services import split_cost
from catalog.tokenizer import tokenizer_for
from conftest import make_host
from hosts.models import Host
from marketplace import services
from marketplace.lifecycle.errors import CompletionRefused
from marketplace.models import Audit, Job, RingInquiry, StageShare
from marketplace.tests.test_ring_pay import host_earned
from marketplace.trust import audits
from mesh.rings.models import ModelLayout
from mesh.rings.services import StageSpec, ring_plan_create
from testkit.requests import submit_request

pytestmark = [pytest.mark.django_db, pytest.mark.audits]

TEXT = "A ring of stages answered this."


def _tokens(catalog) -> list[int]:  # noqa: ANN001
    """What the bridge reports: the ids spelling its answer and an end of generation (evidence
    a completion must carry; not the seed's draw, so an audit that reads them fails)."""
    tokenizer = tokenizer_for(catalog.tokenizer)
    return [*tokenizer.token_ids(TEXT), tokenizer.end_of_generation()]


@pytest.fixture
def ring(catalog, settings):  # noqa: ANN001, ANN201
    """A bridge in probation (every job of it drawn) with two stage hosts of other owners."""
    settings.AUDIT_PROBATION_RATE = 1.0
    n_layers = ModelLayout.objects.get(model=catalog).n_layers
    bridge, first, last = (
        make_host(name="bridge"),
        make_host(qualified=False, name="a"),
        make_host(qualified=False, name="b"),
    )
    third = n_layers // 3
    ring_plan_create(
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
    return bridge, first, last


def serve(
    customer, catalog, bridge, *, token_ids: list[int] | None | bool = True, top_p: float = 1.0, **asked: object
) -> Job:  # noqa: ANN001
    submit_request(
        customer, catalog, stream=True, seed=7, max_tokens=40, prompt_tokens=37, temperature=0.7, top_p=top_p, **asked
    )
    job = services.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint)
    services.job_push_tokens(host=bridge.host, job_id=job.pk, seq=0, text=TEXT)
    services.job_complete(
        host=bridge.host,
        job_id=job.pk,
        finish_reason="stop",
        token_ids=_tokens(catalog) if token_ids is True else token_ids or None,
    )
    return Job.objects.select_related("request").get(pk=job.pk)


def escrow() -> int:
    account = Account.objects.filter(kind=Account.Kind.AUDIT_ESCROW).first()
    return account.balance_ucents if account else 0


def test_a_rings_job_is_audited_with_every_hosts_share_in_escrow_and_a_pass_pays_each(customer, catalog, ring) -> None:  # noqa: ANN001
    bridge, first, last = ring
    job = serve(customer, catalog, bridge)
    audit = Audit.objects.get(job=job)
    shares = dict(StageShare.objects.filter(job=job).values_list("host_id", "earned_ucents"))
    hosts_share = split_cost(job.request.cost_ucents).host_ucents
    assert audit.host_id == bridge.host.pk and audit.token_ids == _tokens(catalog)
    assert set(shares) == {first.host.pk, last.host.pk}
    assert escrow() == audit.host_ucents == job.earned_ucents + sum(shares.values()) <= hosts_share
    assert (
        audit.platform_ucents == job.request.cost_ucents - audit.host_ucents
    )  # the platform's own, no stage share in it
    assert all(host_earned(h.host) == 0 for h in ring), "nobody is paid before the audit"
    assert audits.audit_decide(audit=audit, reason=None, counts={"checked": 4})
    assert escrow() == 0
    assert host_earned(bridge.host) == job.earned_ucents
    assert {h.host.pk: host_earned(h.host) for h in (first, last)} == shares
    assert ledger.reconcile_report() == []


def test_a_failed_rings_audit_refunds_everything_and_opens_an_inquiry_before_blaming_anyone(
    customer, catalog, ring
) -> None:  # noqa: ANN001
    bridge, first, last = ring
    before = ledger.customer_account(user=customer.user).available_ucents
    job = serve(customer, catalog, bridge)
    audit = Audit.objects.get(job=job)
    assert audits.audit_decide(audit=audit, reason="token 2 is not the seed's draw", counts={"checked": 4, "misses": 3})
    assert ledger.customer_account(user=customer.user).available_ucents == before  # every µ¢ back
    assert escrow() == 0 and all(host_earned(h.host) == 0 for h in ring)
    assert not Host.objects.filter(pk__in=[h.host.pk for h in ring], maintenance_since__isnull=False).exists()
    inquiry = RingInquiry.objects.get(audit=audit)  # whose fault it was is found first (test_ring_inquiries.py)
    assert inquiry.status == RingInquiry.Status.COLLECTING and inquiry.token_ids == _tokens(catalog) and inquiry.payload
    assert Audit.objects.get(pk=audit.pk).payload is None  # the audit's own copy is gone, as for every audit
    assert ledger.reconcile_report() == []


def test_a_failed_audit_of_a_ring_all_on_its_bridge_blames_the_bridge(customer, catalog, settings) -> None:  # noqa: ANN001
    settings.AUDIT_PROBATION_RATE = 1.0
    n_layers = ModelLayout.objects.get(model=catalog).n_layers
    bridge = make_host(name="alone")
    ring_plan_create(
        model_name=catalog.name,
        row_width=64,
        micro_batch=2,
        bridge_host=bridge.host,
        stages=[StageSpec(0, 4, None), StageSpec(4, n_layers, bridge.host)],
    )
    audit = Audit.objects.get(job=serve(customer, catalog, bridge))
    assert audits.audit_decide(audit=audit, reason="token 2 is not the seed's draw", counts={"misses": 3})
    assert Host.objects.get(pk=bridge.host.pk).maintenance_by == "verification"
    assert not RingInquiry.objects.exists()


def test_a_job_at_top_p_below_1_is_drawn_like_any_other(customer, catalog, ring) -> None:  # noqa: ANN001
    bridge, first, _ = ring
    job = serve(customer, catalog, bridge, top_p=0.9)
    audit = Audit.objects.get(job=job)
    assert audit.host_id == bridge.host.pk and audit.token_ids == _tokens(catalog)
    assert host_earned(bridge.host) == 0 == host_earned(first.host)  # in escrow until the audit


def test_a_rings_job_that_resumes_text_is_drawn_as_any_hosts(customer, catalog, ring) -> None:  # noqa: ANN001
    """A ring heals a cut word as a single-machine host does (mahout 0.6.0; its honest answers pass
    the verifier: mahout/tests/test_ring_audit.py), so its jobs that resume text are drawn too,
    unlike an MoE coordinator's."""
    bridge, first, _ = ring
    resumed = [{"role": "user", "content": "Finish this."}, {"role": "assistant", "content": "Once upon a ti"}]
    job = serve(customer, catalog, bridge, messages=resumed)
    assert Audit.objects.get(job=job).host_id == bridge.host.pk
    assert host_earned(bridge.host) == 0 == host_earned(first.host)  # in escrow until the audit


def test_a_ring_that_reports_no_tokens_is_refused_at_completion(customer, catalog, ring) -> None:  # noqa: ANN001
    """Withholding the tokens dodges nothing: the completion is refused before any audit or pay."""
    bridge, _, _ = ring
    with pytest.raises(CompletionRefused, match="no token ids"):
        serve(customer, catalog, bridge, token_ids=None)
    assert not Audit.objects.exists() and host_earned(bridge.host) == 0


def test_an_expert_meshs_coordinator_is_drawn_as_any_host_text_it_resumes_included(customer, catalog, settings) -> None:  # noqa: ANN001
    """A MoE coordinator draws by the specified sampler, streams as llama.cpp does and (mahout
    0.7.0) heals the text a job resumes as a host does, so all its answers are audited as any
    host's: a chat ending in a cut word too (before, those were left unaudited)."""
    from mesh.experts.models import ExpertModel

    settings.AUDIT_PROBATION_RATE = 1.0
    coordinator = make_host(name="coordinator")
    ExpertModel.objects.create(
        name=catalog.name,
        gguf_path="/models/moe.gguf",
        arch="qwen3moe",
        n_layers=2,
        n_experts=8,
        n_experts_used=2,
        coordinator=coordinator.host,
    )
    assert Audit.objects.get(job=serve(customer, catalog, coordinator)).host_id == coordinator.host.pk
    resumed = [{"role": "user", "content": "Finish this."}, {"role": "assistant", "content": "Once upon a ti"}]
    job = serve(customer, catalog, coordinator, messages=resumed)
    assert Audit.objects.get(job=job).host_id == coordinator.host.pk
