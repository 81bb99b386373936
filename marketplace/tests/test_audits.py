"""Audits of real jobs (marketplace/trust/audits.py): chosen at completion, the host's share held in
escrow, the answer re-read under the real model, then the host paid or the customer refunded."""

from __future__ import annotations

import pytest

from billing import selectors as ledger
from billing.models import Account
from catalog.tokenizer import tokenizer_for
from marketplace import services
from marketplace.lifecycle.errors import CompletionRefused
from marketplace.models import Audit, Job, Request
from marketplace.trust import audits
from mesh.experts import selectors as expert_selectors
from mesh.experts import services as expert_services
from mesh.experts.models import ExpertModel
from testkit.evidence import drawn
from testkit.requests import submit_request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.audits]


def _escrow() -> int:
    account = Account.objects.filter(kind=Account.Kind.AUDIT_ESCROW).first()
    return account.balance_ucents if account else 0


def _host_balance(host) -> int:  # noqa: ANN001
    account = ledger.host_account(host=host)
    return account.balance_ucents if account else 0


def _served(customer, catalog, serving_host, *, text: str = "Hello there.", **params):  # noqa: ANN001, ANN003
    """A job served with `text` and the token ids spelling it (evidence the completion must
    carry; not the seed's draw, so an audit that reads them fails)."""
    request = submit_request(customer, catalog, **params)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    assert job is not None and job.request_id == request.pk
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=text)
    services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
    request.refresh_from_db()
    return request, job


def test_every_job_carries_its_seed_the_customers_or_the_gateways(customer, catalog, serving_host) -> None:
    payloads = []
    for seed in (7, None, None):
        submit_request(customer, catalog, seed=seed)
        payload = services.job_claim_payload(host=serving_host.host, model_ids=[catalog.pk])
        services.job_fail(
            host=serving_host.host, job_id=payload["id"], reason="only the payload was wanted", cause="request"
        )
        payloads.append(payload)
    seeds = [payload["params"]["seed"] for payload in payloads]
    assert seeds[0] == 7
    assert seeds[1] != seeds[2]
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert seeds[1] == audits.job_seed(job_id=payloads[1]["id"], params={"seed": None})  # fixed by the gateway, stable


def test_a_probation_hosts_job_is_audited_and_its_share_waits_in_escrow(
    customer, catalog, serving_host, settings
) -> None:
    settings.AUDIT_PROBATION_RATE = 1.0
    request, job = _served(customer, catalog, serving_host, temperature=0.8)
    audit = Audit.objects.get(job=job)
    assert audit.status == Audit.Status.PENDING and audit.host_id == serving_host.host.pk
    assert request.cost_ucents > 0 and request.status == Request.Status.COMPLETED
    assert audit.host_ucents + audit.platform_ucents == request.cost_ucents
    assert audit.host_ucents == request.cost_ucents * settings.HOST_SHARE_PERCENT // 100
    assert _escrow() == audit.host_ucents and _host_balance(serving_host.host) == 0
    assert audit.payload["messages"] == [{"role": "user", "content": "hi"}] and audit.text == "Hello there."
    assert audit.token_ids == _spelled(catalog, "Hello there.") and audit.seed == audit.payload["params"]["seed"]
    assert request.messages is None  # the request's own copy goes at settlement as always
    assert Job.objects.get(pk=job.pk).earned_ucents == audit.host_ucents  # the owner's job list shows nothing else


def _spelled(catalog, text: str) -> list[int]:  # noqa: ANN001
    tokenizer = tokenizer_for(catalog.tokenizer)
    return [*tokenizer.token_ids(text), tokenizer.end_of_generation()]


def test_a_passed_audit_pays_the_host_and_forgets_the_answer(customer, catalog, serving_host, settings) -> None:
    settings.AUDIT_PROBATION_RATE = 1.0
    _, job = _served(customer, catalog, serving_host)
    audit = Audit.objects.get(job=job)
    assert audits.audit_decide(audit=audit, reason=None, counts={"checked": 4, "uncertain": 0, "misses": 0})
    assert not audits.audit_decide(audit=audit, reason=None, counts={})  # decided once
    audit.refresh_from_db()
    assert audit.status == Audit.Status.PASSED and audit.checked == 4
    assert audit.payload is None and audit.text == "" and audit.token_ids is None
    assert _escrow() == 0 and _host_balance(serving_host.host) == audit.host_ucents
    assert ledger.reconcile_report() == []


def test_a_failed_audit_refunds_the_customer_and_stops_the_host(customer, catalog, serving_host, settings) -> None:
    settings.AUDIT_PROBATION_RATE = 1.0
    before = ledger.customer_account(user=customer.user).balance_ucents
    request, job = _served(customer, catalog, serving_host)
    assert ledger.customer_account(user=customer.user).balance_ucents == before - request.cost_ucents
    audit = Audit.objects.get(job=job)
    assert audits.audit_decide(audit=audit, reason="token 3 is not the seed's draw (margin 0.41)", counts={"misses": 1})
    audit.refresh_from_db()
    serving_host.host.refresh_from_db()
    assert audit.status == Audit.Status.FAILED and audit.misses == 1
    assert ledger.customer_account(user=customer.user).balance_ucents == before  # every µ¢ back
    assert _escrow() == 0 and _host_balance(serving_host.host) == 0
    assert serving_host.host.maintenance_since is not None
    assert "token 3 is not the seed's draw" in serving_host.host.maintenance_reason
    assert request.public_id in serving_host.host.maintenance_reason
    assert ledger.reconcile_report() == []


def _coordinates(catalog, host) -> ExpertModel:  # noqa: ANN001
    """`host` becomes the bound coordinator of an expert mesh selling `catalog`'s model."""
    return ExpertModel.objects.create(
        name=catalog.name,
        gguf_path="moe.gguf",
        arch="qwen3moe",
        n_layers=2,
        n_experts=8,
        n_experts_used=2,
        coordinator=host,
    )


def _fail(audit: Audit) -> None:
    assert audits.audit_decide(audit=audit, reason="token 3 is not the seed's draw (margin 0.41)", counts={"misses": 1})


def test_a_coordinators_failed_audit_its_volunteers_helped_with_is_excused_once(
    customer,
    catalog,
    serving_host,  # noqa: ANN001
    settings,
) -> None:
    settings.AUDIT_PROBATION_RATE = 1.0
    mesh = _coordinates(catalog, serving_host.host)
    before = ledger.customer_account(user=customer.user).balance_ucents
    _, job = _served(customer, catalog, serving_host)
    expert_services.coordinator_report(host=serving_host.host, model_name=catalog.name, busy=3, engaged_experts=4)
    _fail(Audit.objects.get(job=job))
    serving_host.host.refresh_from_db()
    mesh.refresh_from_db()
    assert serving_host.host.maintenance_since is None and expert_selectors.excused_lately(mesh)
    assert ledger.customer_account(user=customer.user).balance_ucents == before  # refunded all the same
    assert _host_balance(serving_host.host) == 0 and _escrow() == 0

    _, again = _served(customer, catalog, serving_host)  # within the window: its own fault
    expert_services.coordinator_report(host=serving_host.host, model_name=catalog.name, busy=3, engaged_experts=2)
    _fail(Audit.objects.get(job=again))
    serving_host.host.refresh_from_db()
    assert serving_host.host.maintenance_since is not None
    assert ledger.customer_account(user=customer.user).balance_ucents == before
    assert ledger.reconcile_report() == []


def test_a_coordinator_whose_workers_computed_nothing_of_the_answer_is_stopped(
    customer,
    catalog,
    serving_host,  # noqa: ANN001
    settings,
) -> None:
    settings.AUDIT_PROBATION_RATE = 1.0
    _coordinates(catalog, serving_host.host)
    expert_services.coordinator_report(host=serving_host.host, model_name=catalog.name, busy=3, engaged_experts=4)
    _, job = _served(customer, catalog, serving_host)  # asked after the workers last computed
    expert_services.coordinator_report(
        host=serving_host.host, model_name=catalog.name, busy=3, engaged_experts=0, probed_experts=6
    )  # probes are checked, never in an answer
    _fail(Audit.objects.get(job=job))
    serving_host.host.refresh_from_db()
    assert serving_host.host.maintenance_since is not None


def test_a_trusted_host_is_audited_at_the_audit_rate(customer, catalog, settings) -> None:
    from testkit.personas import make_host

    trusted = make_host(trusted=True)
    settings.AUDIT_RATE = 0.0
    _, job = _served(customer, catalog, trusted)
    assert not Audit.objects.filter(job=job).exists()
    assert _host_balance(trusted.host) > 0 and _escrow() == 0
    settings.AUDIT_RATE = 1.0
    _, job = _served(customer, catalog, trusted)
    assert Audit.objects.filter(job=job).exists()


def test_grammar_jobs_are_audited_and_disabled_audits_audit_nothing(customer, catalog, serving_host, settings) -> None:
    settings.AUDIT_PROBATION_RATE = 1.0
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    _, job = _served(customer, catalog, serving_host, text="{}", response_format=schema)
    assert Audit.objects.get(job=job).payload["params"]["response_format"]["type"] == "json_schema"
    settings.AUDIT_ENABLED = False
    _, job = _served(customer, catalog, serving_host)
    assert not Audit.objects.filter(job=job).exists()


def test_a_continuation_is_audited_on_its_own_text_against_the_payload_it_was_sent(
    customer, catalog, serving_host, settings
) -> None:
    from testkit.personas import make_host

    settings.AUDIT_PROBATION_RATE = 1.0
    submit_request(customer, catalog)
    first = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    services.job_push_tokens(host=serving_host.host, job_id=first.pk, seq=0, text="The elephant wal")
    assert services.host_connection_lost(host_id=serving_host.host.pk) == 1
    rescuer = make_host(name="rescuer")
    sent = services.job_claim_payload(host=rescuer.host, model_ids=[catalog.pk])
    assert sent["continuation"] and sent["messages"][-1] == {"role": "assistant", "content": "The elephant wal"}
    services.job_push_tokens(host=rescuer.host, job_id=sent["id"], seq=0, text="ked to the river.")
    services.job_complete(host=rescuer.host, job_id=sent["id"], finish_reason="stop", token_ids=drawn(sent["id"]))
    audit = Audit.objects.get(job_id=sent["id"])
    assert audit.host_id == rescuer.host.pk and audit.text == "ked to the river."
    assert audit.token_ids == _spelled(catalog, "ked to the river.")
    kept = {key: value for key, value in sent.items() if key != "cache_key"}  # (the claiming host's alone)
    assert audit.payload == kept, "rebuilt at settlement as it was sent: without the continuation's own text"


def test_an_answer_without_its_tokens_is_refused_before_any_audit(customer, catalog, serving_host, settings) -> None:
    """It used to fail its audit (with its share in escrow); now it is refused at completion
    (`marketplace.lifecycle.evidence`), so nothing reaches an audit or an escrow."""
    settings.AUDIT_PROBATION_RATE = 1.0
    submit_request(customer, catalog)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there.")
    with pytest.raises(CompletionRefused, match="no token ids"):
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=None)
    assert not Audit.objects.filter(job=job).exists() and _escrow() == 0


def _prompt_anywhere(marker: str) -> list[str]:
    """Every table and column of the database whose text holds `marker` (the whole schema read,
    JSON and text columns alike, as an operator's dump would show it)."""
    from django.apps import apps
    from django.db import connection

    found = []
    with connection.cursor() as cursor:
        for model in apps.get_models():
            for field in model._meta.concrete_fields:
                if field.get_internal_type() not in ("TextField", "CharField", "JSONField"):
                    continue
                table, column = connection.ops.quote_name(model._meta.db_table), connection.ops.quote_name(field.column)
                cast = f"CAST({column} AS TEXT)" if field.get_internal_type() == "JSONField" else column
                cursor.execute(f"SELECT COUNT(*) FROM {table} WHERE {cast} LIKE %s", [f"%{marker}%"])
                if cursor.fetchone()[0]:
                    found.append(f"{model._meta.db_table}.{field.column}")
    return found


@pytest.mark.parametrize("verdict", ["passed", "failed", "unscored"])
def test_an_audited_request_settles_when_its_audit_is_decided_and_no_prompt_byte_outlives_it(
    customer,
    catalog,
    serving_host,
    settings,
    verdict,  # noqa: ANN001
) -> None:
    from django.test import Client

    settings.AUDIT_PROBATION_RATE = 1.0
    marker = "a-secret-prompt-7f3c1e"
    request, job = _served(
        customer, catalog, serving_host, messages=[{"role": "user", "content": f"Remember {marker}."}]
    )
    generation = (
        Client().get(f"/v1/generation?id={request.public_id}", HTTP_AUTHORIZATION=f"Bearer {customer.secret}").json()
    )
    assert (generation["status"], generation["settled"]) == ("completed", False), "its cost may still be refunded"
    assert _prompt_anywhere(marker) == ["marketplace_audit.payload"], "the audit row alone keeps it, for its scorers"
    audit = Audit.objects.get(job=job)
    if verdict == "unscored":
        assert audits.audit_unscored(audit=audit, why="no independent scorer")
    else:
        assert audits.audit_decide(
            audit=audit, reason=None if verdict == "passed" else "token 3 is not the seed's draw", counts={"checked": 4}
        )
    generation = (
        Client().get(f"/v1/generation?id={request.public_id}", HTTP_AUTHORIZATION=f"Bearer {customer.secret}").json()
    )
    assert generation["settled"] is True
    assert _prompt_anywhere(marker) == [], "settled: no prompt byte left in the record"
    assert ledger.reconcile_report() == []


def test_an_n_request_is_settled_only_once_every_choice_has_ended(customer, catalog) -> None:  # noqa: ANN001
    from marketplace import selectors

    first = submit_request(customer, catalog)
    later = submit_request(customer, catalog, choice_of=first.public_id)
    Request.objects.filter(pk=first.pk).update(status=Request.Status.COMPLETED)
    first.refresh_from_db()
    assert not selectors.request_settled(first, later=selectors.later_choices(first)), "a later choice still runs"
    Request.objects.filter(pk=later.pk).update(status=Request.Status.COMPLETED)
    assert selectors.request_settled(first, later=selectors.later_choices(first))
