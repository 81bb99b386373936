"""A host dies mid-sentence and the sentence still finishes: real gateway, real
mahout processes running the shipped model, `kill -9` and SIGSTOP."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING

import openai
import pytest

from billing import selectors as ledger
from billing.models import Hold
from catalog.pricing import price
from catalog.tokenizer import tokenizer_for
from conftest import make_customer, make_host, wait_until
from hosts.models import Host
from marketplace.models import Job, Request

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable

    from openai.types.chat import ChatCompletionChunk

    from catalog.models import CatalogModel
    from testkit.personas import Customer
    from testkit.stack import Gateway, Mahout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

STORY = [{"role": "user", "content": "Tell me a long story about an elephant who learns to swim."}]
KILL_ROUNDS = int(os.environ.get("FAILOVER_ROUNDS", "10"))


class Farm:
    """Real hosts by id, so a test can kill the one serving a request."""

    def __init__(self, start_mahout: Callable[..., Mahout]) -> None:
        self.start_mahout = start_mahout
        self.hosts: dict[int, tuple[str, Mahout]] = {}

    def add(self, name: str) -> int:
        host = make_host(qualified=False, name=name)
        self.hosts[host.host.pk] = (host.token, self.start_mahout(host.token))
        return host.host.pk

    def restart(self, host_id: int) -> None:
        token, _ = self.hosts[host_id]
        self.hosts[host_id] = (token, self.start_mahout(token))

    def process(self, host_id: int) -> subprocess.Popen:
        return self.hosts[host_id][1].proc


def client(gateway: Gateway, customer: Customer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=120)


def serving_host(request_public_id: str, attempt: int = 1) -> int:
    job = wait_until(
        lambda: Job.objects.filter(request__public_id=request_public_id, attempt=attempt, status="running").first(),
        timeout=30,
        what=f"attempt {attempt} to run",
    )
    return job.host_id


def stream_and_strike(
    gateway: Gateway, customer: Customer, strike: Callable[[str], None], *, after_chunks: int = 3, max_tokens: int = 48
) -> tuple[str, ChatCompletionChunk | None, openai.APIError | None]:
    """Stream a story; after a few text chunks call strike(request id). Returns (text, last chunk, error)."""
    pieces: list[str] = []
    last = None
    struck = False
    try:
        for chunk in client(gateway, customer).chat.completions.create(
            model="gemma-3-270m", messages=STORY, max_tokens=max_tokens, temperature=0, stream=True
        ):
            last = chunk
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if not struck and len(pieces) >= after_chunks:
                struck = True
                strike(chunk.id)
    except openai.APIError as error:
        return "".join(pieces), last, error
    return "".join(pieces), last, None


def assert_seamless_and_billed_once(public_id: str, text: str, dead_host: int) -> Request:
    row = Request.objects.get(public_id=public_id)
    jobs = list(row.jobs.order_by("attempt"))
    assert [j.attempt for j in jobs] == [1, 2] and row.resumed
    assert sum(j.generated_chars for j in jobs) == len(text), "every character arrived exactly once across the seam"
    counted = min(tokenizer_for(row.model.tokenizer).count(text, special=False), row.params["max_tokens"])
    assert row.completion_tokens == counted
    assert row.cost_ucents == price(  # (a prompt the customer sent before: its held prefix at the cached price)
        row.model, prompt_tokens=row.prompt_tokens, completion_tokens=counted, cached_tokens=row.cached_tokens
    )
    assert jobs[0].host_id == dead_host and jobs[0].status == "failed" and jobs[0].earned_ucents == 0
    assert jobs[1].earned_ucents <= counted * row.model.output_price_ucents * 80 // 100
    return row


@pytest.fixture
def farm(gateway: Gateway, catalog: CatalogModel, start_mahout: Callable[..., Mahout]) -> Farm:
    return Farm(start_mahout)


class KillTests:
    def test_kill_9_mid_stream_is_continued_seamlessly_round_after_round(self, gateway, farm) -> None:
        ids = [farm.add("left"), farm.add("right")]
        customer = make_customer()
        outcomes = {"resumed": 0, "failed": 0}
        for _ in range(KILL_ROUNDS):
            victim: list[int] = []

            def kill(public_id: str, victim: list[int] = victim) -> None:
                victim.append(serving_host(public_id))
                farm.process(victim[0]).kill()

            text, last, error = stream_and_strike(gateway, customer, kill)
            if error is not None:  # honest failure is allowed, a silent half answer is not
                assert last is None or last.choices[0].finish_reason is None
                outcomes["failed"] += 1
            else:
                assert last.model_extra.get("x_elephant") == {"resumed": True}
                assert_seamless_and_billed_once(last.id, text, victim[0])
                outcomes["resumed"] += 1
            farm.process(victim[0]).wait(timeout=10)
            farm.restart(victim[0])
        assert outcomes["resumed"] >= KILL_ROUNDS - 2, outcomes
        for host_id in ids:
            account = ledger.host_account(host=Host.objects.get(pk=host_id))
            earned = sum(
                Job.objects.filter(host_id=host_id, status="completed").values_list("earned_ucents", flat=True)
            )
            assert (account.balance_ucents if account else 0) == earned, "dead attempts earned nothing"
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []
        assert not Hold.objects.filter(status="active").exists()

    def test_a_double_failure_ends_in_an_honest_error_and_no_charge(self, gateway, farm) -> None:
        farm.add("first")
        farm.add("second")
        customer = make_customer()

        def kill_both(public_id: str) -> None:
            first = serving_host(public_id)
            farm.process(first).kill()
            second = serving_host(public_id, attempt=2)
            farm.process(second).kill()

        text, last, error = stream_and_strike(gateway, customer, kill_both)
        assert error is not None and "took over" in str(error)
        row = Request.objects.get()
        assert (row.status, row.error_code, row.cost_ucents) == ("failed", "host_failed", 0)
        account = ledger.customer_account(user=customer.user)
        assert (account.balance_ucents, account.held_ucents) == (500_000_000, 0)

    def test_a_whole_response_waits_and_says_it_was_resumed(self, gateway, farm) -> None:
        farm.add("first")
        farm.add("second")
        customer = make_customer()

        def killer() -> None:
            # the customer's job: the gateway's own canaries and audits may run on these hosts too
            job = wait_until(
                lambda: Job.objects.filter(
                    request__user=customer.user, status="running", generated_chars__gt=0
                ).first(),
                timeout=60,
                what="text",
            )
            farm.process(job.host_id).kill()

        thread = threading.Thread(target=killer)
        thread.start()
        raw = client(gateway, customer).chat.completions.with_raw_response.create(
            model="gemma-3-270m", messages=STORY, max_tokens=48, temperature=0
        )
        thread.join()
        answer = raw.parse()
        assert raw.headers.get("x-elephant-resumed") == "true"
        jobs = Job.objects.filter(request__public_id=answer.id)
        assert len(answer.choices[0].message.content) == sum(jobs.values_list("generated_chars", flat=True))


class FreezeTests:
    def test_a_frozen_host_is_caught_by_the_stall_rule_and_fenced(self, gateway, farm) -> None:
        farm.add("first")
        farm.add("second")
        customer = make_customer()
        frozen: list[int] = []

        def freeze(public_id: str) -> None:
            frozen.append(serving_host(public_id))
            farm.process(frozen[0]).send_signal(signal.SIGSTOP)

        started = time.monotonic()
        text, last, error = stream_and_strike(gateway, customer, freeze)
        assert error is None and last.model_extra.get("x_elephant") == {"resumed": True}
        assert time.monotonic() - started >= 19, "caught by the 20 s rule, not by a dropped connection"
        row = assert_seamless_and_billed_once(last.id, text, frozen[0])
        farm.process(frozen[0]).send_signal(signal.SIGCONT)  # it wakes up and tries to keep talking
        time.sleep(2)
        first = row.jobs.get(attempt=1)
        assert first.status == "failed" and "no token" in first.fail_reason
        assert Job.objects.get(pk=first.pk).generated_chars == first.generated_chars, "late batches were refused"


class HalfWordTests:
    def test_a_continuation_resumes_mid_word_on_the_real_model(self, gateway, farm) -> None:
        farm.add("solo")
        customer = make_customer()
        api = client(gateway, customer)
        question = [{"role": "user", "content": "Describe an elephant in one paragraph."}]
        whole = (
            api.chat.completions.create(model="gemma-3-270m", messages=question, max_tokens=40, temperature=0)
            .choices[0]
            .message.content
        )
        cut = next(
            i
            for i in range(len(whole) // 3, len(whole) - 2)
            if whole[i - 1].isalpha() and whole[i].isalpha() and whole[i + 1].isalpha()
        )
        word_end = next((j for j in range(cut, len(whole)) if not whole[j].isalpha()), len(whole))
        prefix, rest_of_word = whole[:cut], whole[cut:word_end]
        continued = (
            api.chat.completions.create(
                model="gemma-3-270m",
                messages=[*question, {"role": "assistant", "content": prefix}],
                max_tokens=16,
                temperature=0,
            )
            .choices[0]
            .message.content
        )
        assert continued.startswith(rest_of_word), f"cut {prefix!r} | expected {rest_of_word!r}… got {continued!r}"


class CreditTests:
    def test_credit_running_out_mid_stream_lets_the_running_job_finish(self, gateway, farm, catalog) -> None:
        farm.add("solo")
        from catalog.rendering import prompt_count, prompt_fragments
        from marketplace.services import estimate_ucents

        prompt_tokens = prompt_count(catalog, prompt_fragments(catalog, kind="chat", messages=STORY, prompt=None))
        estimate = estimate_ucents(model=catalog, prompt_tokens=prompt_tokens, max_tokens=48)
        customer = make_customer(credit_ucents=estimate + estimate // 2)
        refused: list[int] = []

        def second_request(public_id: str) -> None:
            try:
                client(gateway, customer).chat.completions.create(model="gemma-3-270m", messages=STORY, max_tokens=48)
            except openai.APIStatusError as error:
                refused.append(error.status_code)

        text, last, error = stream_and_strike(gateway, customer, second_request)
        assert error is None and last.choices[0].finish_reason in ("stop", "length") and text
        assert refused == [402]
        row = Request.objects.get(status="completed")
        account = ledger.customer_account(user=customer.user)
        assert account.balance_ucents == estimate + estimate // 2 - row.cost_ucents and account.held_ucents == 0
