"""End to end: a real daphne gateway, real mahout processes running the shipped
model, driven by the `openai` client as a customer would."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from billing import selectors as ledger
from billing.models import Account, Hold
from conftest import ROOT, make_customer, make_host, wait_until
from hosts.models import Host
from marketplace.models import Job, Request
from testkit.personas import present
from testkit.requests import submit_request

if TYPE_CHECKING:
    from collections.abc import Callable

    from catalog.models import CatalogModel
    from testkit.personas import Customer, ServingHost
    from testkit.stack import Gateway, Mahout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

HAIKU = [{"role": "user", "content": "Write a haiku about elephants."}]


def client(gateway: Gateway, customer: Customer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=60)


@pytest.fixture
def served(
    gateway: Gateway, catalog: CatalogModel, start_mahout: Callable[..., Mahout]
) -> tuple[Customer, ServingHost, Mahout]:
    """A customer with credit and one real host serving the shipped model."""
    host = make_host(qualified=False, name="e2e-rig")
    process = start_mahout(host.token)
    return make_customer(), host, process


class StreamingChatTests:
    def test_it_streams_tokens_as_they_are_made_and_settles_to_the_microcent(self, gateway, served) -> None:
        customer, host, _ = served
        arrivals: list[float] = []
        pieces: list[str] = []
        finish = None
        stream = client(gateway, customer).chat.completions.create(
            model="gemma-3-270m",
            messages=HAIKU,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
                pieces.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert len(pieces) >= 3, "tokens must arrive in several chunks, not one buffered body"
        assert arrivals[-1] - arrivals[0] > 0.05
        assert finish in ("stop", "length") and usage is not None

        row = Request.objects.get()
        assert row.status == "completed" and row.messages is None and row.prompt is None
        assert (row.prompt_tokens, row.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
        cost = row.prompt_tokens * 10 + row.completion_tokens * 40
        assert row.cost_ucents == cost
        host_cut = cost * 80 // 100
        assert ledger.host_account(host=Host.objects.get(pk=host.host.pk)).balance_ucents == host_cut
        assert Account.objects.get(kind="platform").balance_ucents == cost - host_cut
        assert ledger.customer_account(user=customer.user).balance_ucents == 500_000_000 - cost
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []
        assert Hold.objects.filter(status="active").count() == 0

    def test_it_streams_over_a_websocket_too(self, gateway, served) -> None:
        import asyncio

        import websockets

        customer, _, _ = served

        async def talk() -> list[dict]:
            url = gateway.url.replace("http", "ws") + "/v1/ws/chat/completions"
            frames = []
            async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {customer.secret}"}) as ws:
                await ws.send(json.dumps({"model": "gemma-3-270m", "messages": HAIKU, "max_tokens": 16}))
                async for frame in ws:
                    frames.append(json.loads(frame))
            return frames

        frames = asyncio.run(talk())
        assert frames[-1] == {"done": True}
        assert frames[0]["object"] == "chat.completion.chunk"
        assert "".join(f["choices"][0]["delta"].get("content", "") for f in frames[:-1]).strip()


class WholeResponseTests:
    def test_chat_returns_one_body_with_usage_and_the_generation_record_agrees(self, gateway, served) -> None:
        customer, _, _ = served
        answer = client(gateway, customer).chat.completions.create(model="gemma-3-270m", messages=HAIKU, max_tokens=16)
        assert answer.choices[0].message.content and answer.usage.completion_tokens >= 1
        record = httpx.get(
            f"{gateway.url}/v1/generation",
            params={"id": answer.id},
            headers={"Authorization": f"Bearer {customer.secret}"},
        ).json()
        assert record["status"] == "completed" and record["resumed"] is False
        assert record["completion_tokens"] == answer.usage.completion_tokens
        assert "messages" not in record and "prompt" not in record and "text" not in json.dumps(record)

    def test_completions_work_streamed_and_whole(self, gateway, served) -> None:
        customer, _, _ = served
        api = client(gateway, customer)
        whole = api.completions.create(
            model="gemma-3-270m", prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert whole.object == "text_completion" and whole.choices[0].text
        chunks = list(
            api.completions.create(
                model="gemma-3-270m",
                prompt="The capital of France is",
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        # Not compared with the whole answer's text: the host reuses its cached prompt,
        # whose logits drift at a near tie.
        assert streamed and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        assert 1 <= chunks[-1].usage.completion_tokens <= 8


class AdmissionTests:
    def test_it_refuses_with_402_before_anything_is_queued(self, gateway, served) -> None:
        _, _, _ = served
        poor = make_customer(credit_ucents=100)
        with pytest.raises(openai.APIStatusError) as refused:
            client(gateway, poor).chat.completions.create(model="gemma-3-270m", messages=HAIKU, max_tokens=100)
        assert refused.value.status_code == 402
        assert refused.value.body["code"] == "insufficient_credit"
        assert not Request.objects.filter(user=poor.user).exists() and not Job.objects.exists()

    def test_the_key_cap_refuses_with_its_own_code(self, gateway, served) -> None:
        capped = make_customer(cap_ucents=500)
        with pytest.raises(openai.APIStatusError) as refused:
            client(gateway, capped).chat.completions.create(model="gemma-3-270m", messages=HAIKU, max_tokens=100)
        assert (refused.value.status_code, refused.value.body["code"]) == (402, "key_limit_exceeded")


class QueueTimeoutTests:
    def test_nobody_claims_so_the_caller_gets_504_and_pays_nothing(self, gateway, catalog) -> None:
        customer = make_customer()
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            client(gateway, customer).chat.completions.create(model="gemma-3-270m", messages=HAIKU, max_tokens=8)
        assert failed.value.status_code == 504 and failed.value.body["code"] == "queue_timeout"
        assert 3.5 < time.monotonic() - started < 15
        row = Request.objects.get()
        assert (row.status, row.cost_ucents, row.messages) == ("failed", 0, None)
        account = ledger.customer_account(user=customer.user)
        assert (account.balance_ucents, account.held_ucents) == (500_000_000, 0)

    def test_a_stream_gets_an_error_event_not_a_success_ending(self, gateway, catalog) -> None:
        customer = make_customer()
        with pytest.raises(openai.APIError) as failed:
            for _ in client(gateway, customer).chat.completions.create(
                model="gemma-3-270m", messages=HAIKU, max_tokens=8, stream=True
            ):
                pass
        assert "No host claimed" in str(failed.value)


class QualificationTests:
    def test_a_host_that_did_not_benchmark_here_cannot_claim(self, gateway, catalog) -> None:
        fresh = present(make_host(qualified=False, name="fresh"))
        elsewhere = present(make_host(name="elsewhere", fingerprint="a" * 64))
        for token, fingerprint in ((fresh.token, "b" * 64), (elsewhere.token, "b" * 64)):
            answer = httpx.post(
                f"{gateway.url}/hosts/api/claim",
                json={"fingerprint": fingerprint, "wait": 0},
                headers={"Authorization": f"Bearer {token}"},
            )
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "not_qualified"


class HostIsolationTests:
    def test_a_host_cannot_touch_another_hosts_job(self, gateway, catalog) -> None:
        customer = make_customer()
        owner, intruder = present(make_host(name="owner")), make_host(name="intruder")
        submit_request(
            customer, catalog, public_id="chatcmpl-iso", messages=HAIKU, max_tokens=8, temperature=0, top_p=1
        )
        claimed = httpx.post(
            f"{gateway.url}/hosts/api/claim",
            json={"fingerprint": owner.fingerprint, "wait": 1},
            headers={"Authorization": f"Bearer {owner.token}"},
        ).json()["job"]
        intruding = {"Authorization": f"Bearer {intruder.token}"}
        for path, body in (
            ("tokens", {"seq": 0, "text": "x"}),
            ("complete", {"finish_reason": "stop"}),
            ("fail", {"reason": "x"}),
        ):
            answer = httpx.post(f"{gateway.url}/hosts/api/jobs/{claimed['id']}/{path}", json=body, headers=intruding)
            assert answer.status_code == 403, path
        assert Job.objects.get().status == "running"


class PauseTests:
    def test_a_paused_host_stops_claiming_and_resumes(self, gateway, catalog, start_mahout, e2e_dirs) -> None:
        host = make_host(qualified=False, name="pausable")
        home = e2e_dirs / "pausable-home"
        start_mahout(host.token, extra=["--home", str(home)])

        def mahout(command: str) -> None:
            subprocess.run(
                [sys.executable, "-m", "mahout", command, "--home", str(home)],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )

        mahout("pause")
        wait_until(
            lambda: Host.objects.get(pk=host.host.pk).paused, timeout=15, what="the heartbeat to report the pause"
        )
        customer = make_customer()
        with pytest.raises(openai.APIStatusError) as failed:
            client(gateway, customer).chat.completions.create(model="gemma-3-270m", messages=HAIKU, max_tokens=8)
        assert failed.value.body["code"] == "queue_timeout"
        mahout("resume")
        wait_until(
            lambda: not Host.objects.get(pk=host.host.pk).paused, timeout=15, what="the heartbeat to report the resume"
        )
        answer = client(gateway, customer).chat.completions.create(model="gemma-3-270m", messages=HAIKU, max_tokens=8)
        assert answer.choices[0].message.content is not None
