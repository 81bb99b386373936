"""End to end (issue 29): a ring's audit that fails finds the stage at fault. A real gateway
audits every job of its ring's bridge (in probation); the ring's tail is a stage process of
another owner that runs a copy of the model with some of its layers' weights swapped (a
cheap imitation of the model). A customer's chat is answered through the ring and billed;
the audit fails and refunds the customer; the stage processes hand over what they kept of
the request; a real mahout host of a fourth owner, trusted, claims the check through its
ordinary claim path, recomputes each stage from its own copy of the model and names the
tail. Only the tail's host is put in maintenance: not the honest head, not the bridge."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from billing import selectors as ledger
from catalog.models import CatalogModel
from conftest import make_customer, make_host, stack_env, wait_until
from hosts.models import Host
from marketplace.models import Audit, RingInquiry
from marketplace.trust import audit_scoring
from mesh.tests.test_ring_e2e import MahoutProcess, wait_for_ring
from testkit.stack import Gateway, Mahout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.audits]

N_CTX = "256"


@pytest.fixture
def audited_gateway(django_db_blocker, e2e_dirs: Path, transactional_db: None) -> Iterator[Gateway]:  # noqa: ANN001
    with django_db_blocker.unblock():
        env = stack_env(
            {
                "AUDIT_ENABLED": "1",
                "AUDIT_PROBATION_RATE": "1",
                "AUDIT_RATE": "0",
                "CANARY_ENABLED": "0",
                "QUEUE_TIMEOUT_SECONDS": "60",
                "RING_ALLOW_PRIVATE_STAGES": "1",
                "HOST_MAX_FAILURES_PER_HOUR": "1000",
            }
        )
    gateway = Gateway(env, e2e_dirs / "logs")
    yield gateway
    gateway.stop()


def imitation(tmp_path: Path) -> Path:
    """A copy of the shipped model whose layers 11-16 have their feed-forward output matrices
    swapped in pairs: the same file format and size, other numbers."""
    import gguf

    from engine.gguf_loader import default_model_path

    copy = tmp_path / "imitation.gguf"
    shutil.copyfile(default_model_path(), copy)
    reader = gguf.GGUFReader(copy, "r+")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    swapped = 0
    for a, b in ((11, 12), (13, 14), (15, 16)):
        x, y = tensors[f"blk.{a}.ffn_down.weight"], tensors[f"blk.{b}.ffn_down.weight"]
        if x.tensor_type == y.tensor_type and x.data.shape == y.data.shape:
            held = x.data.copy()
            x.data[...] = y.data
            y.data[...] = held
            swapped += 1
    reader.data.flush()
    assert swapped >= 2, "the shipped file's layers 11-16 no longer pair up by type"
    return copy


def test_a_stage_running_an_imitation_of_the_model_is_found_and_only_its_host_is_blamed(
    audited_gateway: Gateway, catalog: CatalogModel, e2e_dirs: Path, tmp_path: Path
) -> None:
    from mesh.rings.layouts import layout_seed
    from mesh.rings.models import ModelLayout
    from mesh.rings.services import StageSpec, ring_plan_create

    layout_seed(CatalogModel, ModelLayout)
    head, tail, bridge = (make_host(qualified=False, name=name) for name in ("honest-head", "imitating-tail", "bridge"))
    plan = ring_plan_create(
        model_name="gemma-3-270m",
        stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
        row_width=64,
        micro_batch=2,
        bridge_host=bridge.host,
    )
    common = ["--server", audited_gateway.url, "--ring", str(plan.pk), "--n-ctx", N_CTX, "--wait", "60"]
    logs = e2e_dirs / "logs"
    stages = [
        MahoutProcess(
            f"stage{i}",
            [
                "stage",
                *common,
                "--token",
                host.token,
                "--stage",
                str(i),
                "--bind",
                "127.0.0.1:0",
                "--once",
                "--no-idle-detect",
                "--home",
                str(tmp_path / f"stage{i}"),
                *extra,
            ],
            logs,
        )
        for i, (host, extra) in enumerate(((head, []), (tail, ["--model", str(imitation(tmp_path))])))
    ]
    ring_bridge = MahoutProcess(
        "bridge",
        [
            "ring",
            *common,
            "--token",
            bridge.token,
            "--parallel",
            "2",
            "--bench-tokens",
            "8",
            "--home",
            str(tmp_path / "bridge"),
            "--no-idle-detect",
        ],
        logs,
    )
    processes: list[MahoutProcess | Mahout] = [*stages, ring_bridge]
    try:
        wait_for_ring([*stages, ring_bridge], bridge.host)
        customer = make_customer()
        before = ledger.customer_account(user=customer.user).available_ucents
        client = openai.OpenAI(
            base_url=f"{audited_gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=120
        )
        answer = client.chat.completions.create(
            model="gemma-3-270m",
            max_tokens=24,
            temperature=0.8,
            messages=[{"role": "user", "content": "Write a haiku about elephants."}],
        )
        assert answer.usage.completion_tokens > 0
        audit = Audit.objects.get(request__public_id=answer.id)
        assert audit.host_id == bridge.host.pk and audit.token_ids
        assert audit_scoring.audit_score_pending() == 1
        audit.refresh_from_db()
        assert audit.status == Audit.Status.FAILED, audit.reason
        assert ledger.customer_account(user=customer.user).available_ucents == before  # refunded at once
        inquiry = RingInquiry.objects.get(audit=audit)
        wait_until(
            lambda: RingInquiry.objects.get(pk=inquiry.pk).status == RingInquiry.Status.CHECKING,
            timeout=60,
            what="both stages to hand over their evidence",
            interval=0.5,
        )
        assert not Host.objects.filter(
            pk__in=[head.host.pk, tail.host.pk, bridge.host.pk], maintenance_since__isnull=False
        ).exists()  # nobody is blamed on the audit alone

        checker = make_host(name="checker", trusted=True)  # a fourth owner's machine, serving the real model
        processes.append(
            Mahout(
                server=audited_gateway.url,
                token=checker.token,
                home=tmp_path / "checker",
                env=stack_env(),
                log_dir=logs,
            )
        )
        started = time.monotonic()
        wait_until(
            lambda: RingInquiry.objects.get(pk=inquiry.pk).status == RingInquiry.Status.DECIDED,
            timeout=300,
            what="a trusted host to check the ring's stages",
            interval=1.0,
        )
        checked_s = time.monotonic() - started
        inquiry.refresh_from_db()
        assert [verdict["checker"] for verdict in inquiry.verdicts] == [
            checker.host.pk
        ]  # (no other owner's host could look)
        assert inquiry.blamed == [{"stage": 1, "host": tail.host.pk}], inquiry.verdict
        assert "recomputed on its own inputs differ" in inquiry.verdict
        hosts = {h.pk: h for h in Host.objects.filter(pk__in=[head.host.pk, tail.host.pk, bridge.host.pk])}
        assert hosts[tail.host.pk].maintenance_by == "verification"
        assert "stage 1 of ring" in hosts[tail.host.pk].maintenance_reason
        assert hosts[head.host.pk].maintenance_since is None and hosts[bridge.host.pk].maintenance_since is None
        assert inquiry.payload is None and not inquiry.evidence.exists()
        assert ledger.reconcile_report() == []
        print(f"ring inquiry decided {checked_s:.1f} s after the checker started: {inquiry.verdict}")
    finally:
        for process in processes:
            process.stop()
