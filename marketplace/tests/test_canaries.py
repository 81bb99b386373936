"""Verification: hidden jobs with known answers. An honest host running the real model passes
every canary; a host that returns anything else is in maintenance, named for verification,
without any customer traffic."""
from __future__ import annotations

import subprocess
import sys

import pytest
from django.conf import settings

from catalog.models import CatalogModel
from catalog.tokenizer import shipped_model_path
from conftest import make_host, wait_until
from hosts.models import Host
from mahout.runners.llama import load_llama
from marketplace import canaries
from marketplace.models import CanaryCheck, CanaryReference, Job, Request
from protocol.turns import job_stop_strings, render_job
from testkit.stack import ROOT

COUNT = 32
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    model = load_llama(shipped_model_path(), n_ctx=canaries.REFERENCE_CTX, threads=2, logits_all=True)
    yield model
    model.close()


@pytest.fixture(scope="module")
def computed(llm) -> list[tuple[dict, canaries.Reference]]:  # type: ignore[no-untyped-def]
    """References for the corpus' first prompts, from the real model."""
    return [(item, canaries.reference_of(llm, item, max_tokens=MAX_TOKENS, tie_gap=settings.CANARY_TIE_GAP))
            for item in canaries.corpus()[:COUNT]]


def stored(catalog: CatalogModel, computed: list) -> list[CanaryReference]:
    return CanaryReference.objects.bulk_create([
        CanaryReference(model=catalog, kind=item["kind"], prompt=item.get("messages") or item.get("prompt"), max_tokens=MAX_TOKENS,
                        text=ref.text, tokens=ref.tokens, exact_chars=ref.exact_chars, gaps=[list(g) for g in ref.gaps])
        for item, ref in computed if canaries.informative(item, ref)
    ])


def generate(llm, item: dict, **sampling: object) -> str:  # type: ignore[no-untyped-def]
    job = {"kind": item["kind"], "messages": item.get("messages"), "prompt": item.get("prompt"), "params": {}}
    tokens = llm.tokenize(render_job(job).encode(), add_bos=True, special=True)
    return llm.create_completion(prompt=tokens, max_tokens=MAX_TOKENS, stop=job_stop_strings(job), **sampling)["choices"][0]["text"]


def reference_row(text: str, gaps: list, max_tokens: int = MAX_TOKENS, exact: int = 0) -> CanaryReference:
    return CanaryReference(kind="completion", prompt="p", max_tokens=max_tokens, text=text, tokens=4, exact_chars=exact,
                           gaps=[list(g) for g in gaps])


CAT = "The cat sat on the mat."
CAT_GAPS = [(0, 3.0), (3, 2.5), (7, 2.0), (11, 0.3), (14, 2.0), (18, 2.0), (22, 2.0), (23, 3.0)]  # " on": a near-tie


class VerdictTests:
    def test_an_answer_may_part_from_the_reference_only_at_a_near_tie(self) -> None:
        row = reference_row(CAT, CAT_GAPS)
        assert canaries.verdict_reason(row, text=CAT, completion_tokens=7) is None
        assert canaries.verdict_reason(row, text="The cat sat by the door.", completion_tokens=7) is None  # parted at the tie
        assert "differs" in canaries.verdict_reason(row, text="The dog sat on the mat.", completion_tokens=7)
        assert "stopped after 7" in canaries.verdict_reason(row, text="The cat", completion_tokens=2)
        assert "stopped after 0" in canaries.verdict_reason(row, text="", completion_tokens=0)
        assert "more text than asked" in canaries.verdict_reason(row, text=CAT, completion_tokens=99)
        assert "runs past" in canaries.verdict_reason(row, text=CAT + " And", completion_tokens=8)  # it ended for sure

    def test_what_counts_as_something_to_check(self) -> None:
        assert canaries.decisive_chars(CAT, CAT_GAPS) == len(CAT) - len(" on")
        assert canaries.decisive_chars(CAT, CAT_GAPS, since=14) == len(" the mat.")


class RealModelTests:
    def test_references_have_something_to_check(self, computed) -> None:
        assert sum(1 for item, ref in computed if canaries.informative(item, ref)) >= 3, computed

    def test_honest_greedy_with_another_thread_count_passes_every_canary(self, computed) -> None:
        one_thread = load_llama(shipped_model_path(), n_ctx=2048, threads=1)
        try:
            for item, ref in computed:
                text = generate(one_thread, item, temperature=0.0, top_p=1.0)
                row = reference_row(ref.text, ref.gaps)
                assert canaries.verdict_reason(row, text=text, completion_tokens=ref.tokens) is None, (item, text, ref)
        finally:
            one_thread.close()

    def test_cheats_fail(self, llm, computed) -> None:
        usable = [(item, ref) for item, ref in computed if canaries.informative(item, ref)]
        rows = [reference_row(ref.text, ref.gaps) for _, ref in usable]
        for (item, ref), row in zip(usable, rows, strict=True):
            echo = item.get("prompt") or item["messages"][-1]["content"]
            assert canaries.verdict_reason(row, text=echo, completion_tokens=ref.tokens), "an echo of the prompt"
            assert canaries.verdict_reason(row, text="lorem ipsum dolor sit amet", completion_tokens=5), "random text"
            assert canaries.verdict_reason(row, text=ref.text + " and more", completion_tokens=MAX_TOKENS + 3), "more than asked"
        # cut short: caught within a probation's canaries (where the cut falls on a near-tie it cannot be told)
        cut = [canaries.verdict_reason(row, text=ref.text[: len(ref.text) * 3 // 4], completion_tokens=ref.tokens * 3 // 4)
               for (_, ref), row in zip(usable, rows, strict=True)]
        assert sum(1 for reason in cut if reason) >= 1, cut
        # temperature 1 when 0 was asked: caught within a probation's canaries (each is a fresh draw)
        caught = [canaries.verdict_reason(row, text=generate(llm, item, temperature=1.0, seed=1000 + i), completion_tokens=ref.tokens)
                  for i, ((item, ref), row) in enumerate(zip(usable, rows, strict=True))]
        assert sum(1 for reason in caught if reason) >= 1, caught


def simhost(server: str, token: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "testkit.simhost", "--server", server, "--token", token, "--model", "gemma-3-270m",
         "--loaded", "gemma-3-270m", "--wait", "2", *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
class CanaryEndToEndTests:
    def test_a_host_returning_junk_is_in_maintenance_for_verification_with_no_customer_traffic(self, gateway, catalog, computed) -> None:
        stored(catalog, computed)
        cheat = make_host(name="cheat", fingerprint="s" * 64)
        proc = simhost(gateway.url, cheat.token)
        try:
            host = wait_until(lambda: Host.objects.filter(pk=cheat.host.pk, maintenance_since__isnull=False).first(),
                              timeout=60, what="the cheating host to be caught")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        assert host.maintenance_by == "verification" and host.maintenance_reason.startswith("Failed verification")
        check = CanaryCheck.objects.get(host=host, verdict=CanaryCheck.Verdict.FAILED)
        assert check.request.status == Request.Status.COMPLETED and check.request.cost_ucents > 0  # paid like any job
        assert Job.objects.filter(request=check.request).get().earned_ucents > 0
        assert not Request.objects.filter(canary__isnull=True).exists()  # no customer traffic was needed

    def test_an_honest_mahout_passes_its_canaries(self, gateway, catalog, computed, start_mahout, settings) -> None:
        stored(catalog, computed)
        honest = make_host(name="honest")
        start_mahout(honest.token, extra=["--threads", "1"])
        wait_until(lambda: CanaryCheck.objects.filter(host=honest.host, verdict=CanaryCheck.Verdict.PASSED).count() >= 2,
                   timeout=120, what="two canaries passed")
        host = Host.objects.get(pk=honest.host.pk)
        assert host.maintenance_since is None
        assert not CanaryCheck.objects.filter(host=host, verdict=CanaryCheck.Verdict.FAILED).exists()


@pytest.mark.django_db
class OperatorViewTests:
    def test_the_admin_shows_what_canaries_found_and_cost(self, client, django_user_model) -> None:
        operator = django_user_model.objects.create_superuser("op", "op@example.com", "pw")
        client.force_login(operator)
        page = client.get("/admin/marketplace/canarycheck/")
        assert page.status_code == 200
        assert b"Canaries: 0 passed, 0 failed" in page.content and b"failed verification: nobody" in page.content
