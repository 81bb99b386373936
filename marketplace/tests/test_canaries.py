"""Verification: hidden jobs with known answers. An honest host running the real model passes
every canary; a host that returns anything else is in maintenance, named for verification,
without any customer traffic."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.conf import settings
from django.utils import timezone

from catalog.models import CatalogModel
from catalog.seed import SHIPPED_MODELS
from catalog.tokenizer import shipped_model_path
from conftest import make_host, wait_until
from hosts.models import Host
from marketplace.lifecycle import canaries
from marketplace.models import CanaryCheck, CanaryReference, Job, Request
from protocol.jobs import job_stop_strings
from scorer.llama import load_llama
from testkit.formats import GEMMA
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
    return [
        (item, canaries.reference_of(llm, item, fmt=GEMMA, max_tokens=MAX_TOKENS, tie_gap=settings.CANARY_TIE_GAP))
        for item in canaries.corpus()[:COUNT]
    ]


def stored(catalog: CatalogModel, computed: list) -> list[CanaryReference]:
    return CanaryReference.objects.bulk_create(
        [
            CanaryReference(
                model=catalog,
                kind=item["kind"],
                prompt=item.get("messages") or item.get("prompt"),
                max_tokens=MAX_TOKENS,
                text=ref.text,
                tokens=ref.tokens,
                exact_chars=ref.exact_chars,
                gaps=[list(g) for g in ref.gaps],
            )
            for item, ref in computed
            if canaries.informative(item, ref)
        ]
    )


def generate(llm, item: dict, **sampling: object) -> str:  # type: ignore[no-untyped-def]
    job = canaries.canary_job(GEMMA, kind=item["kind"], messages=item.get("messages"), prompt=item.get("prompt"))
    tokens = canaries.job_tokens(llm, job)
    return llm.create_completion(prompt=tokens, max_tokens=MAX_TOKENS, stop=job_stop_strings(job), **sampling)[
        "choices"
    ][0]["text"]


def reference_row(
    text: str, gaps: list, max_tokens: int = MAX_TOKENS, exact: int = 0, item: dict | None = None
) -> CanaryReference:
    item = item or {"kind": "completion", "prompt": "p"}
    return CanaryReference(
        model=CatalogModel(**SHIPPED_MODELS[0]),
        kind=item["kind"],
        prompt=item.get("messages") or item.get("prompt"),
        max_tokens=max_tokens,
        text=text,
        tokens=4,
        exact_chars=exact,
        gaps=[list(g) for g in gaps],
    )


CAT = "The cat sat on the mat."
CAT_GAPS = [(0, 3.0), (3, 2.5), (7, 2.0), (11, 0.3), (14, 2.0), (18, 2.0), (22, 2.0), (23, 3.0)]  # " on": a near-tie


class VerdictTests:
    def test_an_answer_may_part_from_the_reference_only_at_a_near_tie(self) -> None:
        row = reference_row(CAT, CAT_GAPS)
        assert canaries.verdict_reason(row, text=CAT, completion_tokens=7) is None
        assert (
            canaries.verdict_reason(row, text="The cat sat by the door.", completion_tokens=7) is None
        )  # parted at the tie
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

    def test_honest_greedy_with_another_thread_count_passes_every_canary(self, llm, computed) -> None:
        one_thread = load_llama(shipped_model_path(), n_ctx=2048, threads=1)
        try:
            for item, ref in computed:
                text = generate(one_thread, item, temperature=0.0, top_p=1.0)
                row = reference_row(ref.text, ref.gaps, item=item)
                assert canaries.answer_reason(llm, row, text=text, completion_tokens=ref.tokens) is None, (
                    item,
                    text,
                    ref,
                )
        finally:
            one_thread.close()

    def test_cheats_fail(self, llm, computed) -> None:
        usable = [(item, ref) for item, ref in computed if canaries.informative(item, ref)]
        rows = [reference_row(ref.text, ref.gaps, item=item) for item, ref in usable]
        for (item, ref), row in zip(usable, rows, strict=True):
            echo = item.get("prompt") or item["messages"][-1]["content"]
            assert canaries.answer_reason(llm, row, text=echo, completion_tokens=ref.tokens), "an echo of the prompt"
            assert canaries.answer_reason(llm, row, text="lorem ipsum dolor sit amet", completion_tokens=5), (
                "random text"
            )
            assert canaries.answer_reason(llm, row, text=ref.text + " and more", completion_tokens=MAX_TOKENS + 3), (
                "more than asked"
            )
            # cut short, even where the cut falls on a near-tie: the real model would not have ended there
            cut = ref.text[: len(ref.text) * 3 // 4]
            assert canaries.answer_reason(llm, row, text=cut, completion_tokens=ref.tokens * 3 // 4), ("cut short", cut)
        # temperature 1 when 0 was asked. A draw that strayed only where the model hesitates
        # (each token within CANARY_TIE_GAP of the best) is one honest hardware could write:
        # such draws are rare (bench/trust.py), so nearly every canary catches this cheat.
        hot = [
            (row, generate(llm, item, temperature=1.0, seed=1000 + i))
            for i, ((item, ref), row) in enumerate(zip(usable, rows, strict=True))
        ]
        strayed = [(row, text) for row, text in hot if text != row.text]
        caught = [
            text
            for row, text in strayed
            if canaries.answer_reason(llm, row, text=text, completion_tokens=row.max_tokens)
        ]
        assert len(caught) >= 0.8 * len(strayed) and strayed, (len(caught), len(strayed))

    def test_an_answer_parting_at_a_near_tie_is_scored_under_the_real_model(self, llm, computed) -> None:
        """What the reference alone cannot judge: the answer follows it to a near-tie and then
        goes its own way. Honest runner-up choices pass; junk after the tie fails."""
        item, ref = next(
            (item, ref) for item, ref in computed if canaries.informative(item, ref) and ref.exact_chars < len(ref.text)
        )
        row = reference_row(ref.text, ref.gaps, item=item)
        junk = ref.text[: ref.exact_chars] + " zebra quantum zebra"
        assert (
            canaries.verdict_reason(row, text=junk, completion_tokens=ref.tokens) is None
        )  # the reference says nothing
        assert "not the real model's choice" in canaries.score_reason(llm, row, text=junk, completion_tokens=ref.tokens)


def simhost(server: str, token: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testkit.simhost",
            "--server",
            server,
            "--token",
            token,
            "--model",
            "gemma-3-270m",
            "--loaded",
            "gemma-3-270m",
            "--wait",
            "2",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
class CanaryEndToEndTests:
    def test_a_host_returning_junk_is_in_maintenance_for_verification_with_no_customer_traffic(
        self, gateway, catalog, computed
    ) -> None:
        stored(catalog, computed)
        cheat = make_host(name="cheat", fingerprint="s" * 64)
        proc = simhost(gateway.url, cheat.token)
        try:
            host = wait_until(
                lambda: Host.objects.filter(pk=cheat.host.pk, maintenance_since__isnull=False).first(),
                timeout=60,
                what="the cheating host to be caught",
            )
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

        def passed() -> bool:
            canaries.canary_score_pending()  # the workers' part (Celery beat runs it under make run)
            return CanaryCheck.objects.filter(host=honest.host, verdict=CanaryCheck.Verdict.PASSED).count() >= 2

        wait_until(passed, timeout=120, what="two canaries passed")
        host = Host.objects.get(pk=honest.host.pk)
        assert host.maintenance_since is None
        assert not CanaryCheck.objects.filter(host=host, verdict=CanaryCheck.Verdict.FAILED).exists()


@pytest.mark.django_db
class ScoringTests:
    def test_the_workers_score_what_parted_at_a_near_tie_and_a_failure_sends_the_host_to_maintenance(
        self, catalog, computed
    ) -> None:
        from conftest import make_customer
        from marketplace.tests.test_services import submit

        item, ref = next(
            (item, ref) for item, ref in computed if canaries.informative(item, ref) and ref.exact_chars < len(ref.text)
        )
        (reference,) = stored(catalog, [(item, ref)])
        cheat, honest = (
            make_host(name="cheat", fingerprint="c" * 64).host,
            make_host(name="honest", fingerprint="h" * 64).host,
        )
        junk = CanaryCheck.objects.create(host=cheat, reference=reference, request=submit(make_customer(), catalog))
        same = CanaryCheck.objects.create(host=honest, reference=reference, request=submit(make_customer(), catalog))
        verdict = canaries.canary_judge(
            check=junk,
            host=cheat,
            text=ref.text[: ref.exact_chars] + " zebra quantum zebra",
            completion_tokens=ref.tokens,
            audited=False,
        )
        assert verdict == CanaryCheck.Verdict.SCORING
        assert (
            canaries.canary_judge(check=same, host=honest, text=ref.text, completion_tokens=ref.tokens, audited=False)
            == "passed"
        )
        assert CanaryCheck.objects.get(pk=junk.pk).answer  # kept for the workers, and only until they decide
        assert not canaries.canary_due(host=cheat, now=timezone.now())  # one at a time, scoring included

        assert canaries.canary_score_pending() == 1
        junk.refresh_from_db()
        assert (
            junk.verdict == CanaryCheck.Verdict.FAILED
            and "not the real model's choice" in junk.reason
            and junk.answer == ""
        )
        cheat.refresh_from_db()
        assert cheat.maintenance_by == "verification" and cheat.maintenance_reason.startswith("Failed verification")
        assert canaries.canary_score_pending() == 0  # decided once


@pytest.mark.django_db
class OperatorViewTests:
    def test_the_admin_shows_what_canaries_found_and_cost(self, client, django_user_model) -> None:
        operator = django_user_model.objects.create_superuser("op", "op@example.com", "pw")
        client.force_login(operator)
        page = client.get("/admin/marketplace/canarycheck/")
        assert page.status_code == 200
        assert b"Canaries: 0 passed, 0 failed" in page.content and b"failed verification: nobody" in page.content
