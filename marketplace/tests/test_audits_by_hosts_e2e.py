"""Audits scored by a trusted host, end to end: a real gateway whose catalog entry's weights
file is gone (only hosts hold the model), two hosts in probation that serve customers (one
honest, generating with the real model in this process; one answering junk), a scorer that
fails the junk one (its word alone punishes nobody), and a real mahout, trusted, that claims
both audits through its ordinary claim path and reads them with the model its runner loaded:
it confirms the junk one's failure (the customer is refunded, the cheat put in maintenance)
and passes the honest one (its host is paid); the scorers are paid their fee."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from billing import selectors as ledger
from catalog.models import CatalogModel
from catalog.tokenizer import shipped_model_path, tokenizer_for
from conftest import make_customer, make_host, wait_until
from hosts.models import Host
from mahout import __version__ as mahout_version
from marketplace.models import Audit, AuditScore, Request
from testkit.stack import Gateway, Mahout, stack_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.audits]

ASK = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three large animals."}]
JUNK = "Elephants are wonderful animals that live in many places."


@pytest.fixture
def remote_gateway(
    django_db_blocker, e2e_dirs: Path, transactional_db: None, catalog: CatalogModel
) -> Iterator[Gateway]:  # noqa: ANN001
    """A gateway whose catalog entry was added from a file it no longer has: it cannot audit."""
    CatalogModel.objects.filter(pk=catalog.pk).update(tokenizer="bytes", weights_path=str(e2e_dirs / "gone.gguf"))
    with django_db_blocker.unblock():
        env = stack_env(
            {
                "AUDIT_ENABLED": "1",
                "AUDIT_PROBATION_RATE": "1",
                "AUDIT_RATE": "0",
                "CANARY_ENABLED": "0",
                "QUEUE_TIMEOUT_SECONDS": "30",
            }
        )
    gateway = Gateway(env, e2e_dirs / "logs")
    yield gateway
    gateway.stop()


def _serve(gateway: Gateway, host, answer) -> Request:  # noqa: ANN001
    """A customer's chat served by a synthetic host in probation: `answer(job)` gives the text,
    the token ids and the finish reason it reports."""
    customer = make_customer()
    headers = {"Authorization": f"Bearer {host.token}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        assert (
            http.post(
                "/hosts/api/heartbeat", json={"fingerprint": host.fingerprint, "version": mahout_version}
            ).status_code
            == 200
        )
        answers: list[dict] = []
        ask = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f"{gateway.url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {customer.secret}"},
                    timeout=60,
                    json={"model": "gemma-3-270m", "messages": ASK, "max_tokens": 24, "temperature": 0.8},
                ).json()
            )
        )
        ask.start()
        job = http.post("/hosts/api/claim", json={"fingerprint": host.fingerprint, "wait": 20}).json()["job"]
        text, tokens, finish_reason = answer(job)
        assert http.post(f"/hosts/api/jobs/{job['id']}/tokens", json={"seq": 0, "text": text}).json()["accepted"]
        done = http.post(
            f"/hosts/api/jobs/{job['id']}/complete", json={"finish_reason": finish_reason, "tokens": tokens}
        )
        assert done.status_code == 200, done.text
        ask.join(timeout=60)
    request = Request.objects.get(public_id=answers[0]["id"])
    assert request.cost_ucents > 0
    return request


def _junk(job: dict) -> tuple[str, list[int], str]:
    tokens = tokenizer_for("shipped:gemma-3-270m")._llama.tokenize(JUNK.encode(), add_bos=False, special=False)
    return JUNK, [*tokens, 1], "stop"  # its text's own tokens, then an end of generation


@pytest.fixture
def honest_runner() -> Iterator[object]:
    """The real model, loaded here before the job is claimed (a job must start promptly)."""
    from mahout.runners.llama import LlamaRunner

    runner = LlamaRunner(shipped_model_path(), threads=1, n_ctx=1024)
    yield runner
    runner.close()


def _honest(runner) -> object:  # noqa: ANN001
    def answer(job: dict) -> tuple[str, list[int], str]:
        text = "".join(runner.stream(job))
        return text, list(runner.token_ids), runner.finish_reason

    return answer


def test_a_trusted_mahout_scores_audits_the_gateway_cannot_read(
    remote_gateway: Gateway, honest_runner: object, e2e_dirs: Path
) -> None:
    scorer = make_host(name="trusted scorer", trusted=True)  # qualified already: audits of the model can be scored
    first = make_host(name="first scorer", trusted=True)  # will say the junk fails: alone, that punishes nobody
    cheat, honest = make_host(name="junk"), make_host(name="honest")
    _serve(remote_gateway, first, _junk)  # trusted and AUDIT_RATE 0: not audited (the platform's revenue before)
    cheated = _serve(remote_gateway, cheat, _junk)
    served = _serve(remote_gateway, honest, _honest(honest_runner))
    junk_audit, honest_audit = Audit.objects.get(request=cheated), Audit.objects.get(request=served)
    assert (
        junk_audit.by_hosts
        and honest_audit.by_hosts
        and junk_audit.status == honest_audit.status == Audit.Status.PENDING
    )
    paid_before = ledger.customer_account(user=cheated.user).balance_ucents

    with httpx.Client(
        base_url=remote_gateway.url, headers={"Authorization": f"Bearer {first.token}"}, timeout=30
    ) as http:
        assert (
            http.post(
                "/hosts/api/heartbeat", json={"fingerprint": first.fingerprint, "version": mahout_version}
            ).status_code
            == 200
        )
        claimed = http.post("/hosts/api/claim", json={"fingerprint": first.fingerprint, "wait": 5}).json()["job"]
        assert claimed["kind"] == "audit" and claimed["id"] == junk_audit.pk and claimed["text"] == JUNK
        verdict = http.post(
            f"/hosts/api/audits/{claimed['id']}/verdict", json={"verdict": "failed", "reason": "junk", "misses": 9}
        )
        assert verdict.json() == {"status": "pending"}
    cheat.host.refresh_from_db()
    assert cheat.host.maintenance_since is None

    mahout = Mahout(
        server=remote_gateway.url,
        token=scorer.token,
        home=e2e_dirs / "mahout-home",
        env=stack_env(),
        log_dir=e2e_dirs / "logs",
    )
    try:
        wait_until(
            lambda: (
                not Audit.objects.filter(pk__in=[junk_audit.pk, honest_audit.pk], status=Audit.Status.PENDING).exists()
            ),
            timeout=240,
            what="the trusted mahout to score both audits",
        )
        wait_until(lambda: f"scored audit {honest_audit.pk}:" in mahout.output(), timeout=30, what="mahout to say so")
    finally:
        mahout.stop()
    junk_audit.refresh_from_db()
    honest_audit.refresh_from_db()
    log = mahout.output()
    assert junk_audit.status == Audit.Status.FAILED and junk_audit.misses > 0, (junk_audit.reason, log[-2000:])
    assert honest_audit.status == Audit.Status.PASSED and honest_audit.checked > 0, (honest_audit.reason, log[-2000:])
    assert f"scored audit {honest_audit.pk}: passed" in log and "could not load" not in log
    assert all(a.payload is None and a.text == "" and a.token_ids is None for a in (junk_audit, honest_audit))
    cheat.host.refresh_from_db()
    assert cheat.host.maintenance_since is not None and "Failed verification" in cheat.host.maintenance_reason
    assert ledger.customer_account(user=cheated.user).balance_ucents == paid_before + cheated.cost_ucents  # refunded
    assert ledger.host_account(host=honest.host).balance_ucents == honest_audit.host_ucents > 0
    scores = AuditScore.objects.filter(scorer=scorer.host).order_by("pk")
    assert [s.verdict for s in scores] == ["failed", "passed"]
    assert all(s.paid_ucents > 0 for s in scores)  # both readings paid (the confirmation and the pass)
    assert ledger.host_account(host=scorer.host).balance_ucents == sum(s.paid_ucents for s in scores)
    assert not Host.objects.get(pk=first.host.pk).audit_scores.filter(overruled=True).exists()
    assert ledger.reconcile_report() == []
