"""Prompt caching (issue 53), on the real admission, routing, claim and settlement: a follow-up
turn is offered to the host that served the turn before and its cached prefix is billed at the
cached price (the hold, the bill, `usage`), as the gateway computed it, never as a host says;
only the same account reuses a prefix; every prefix is forgotten after PROMPT_CACHE_SECONDS."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from catalog.models import CatalogModel
from catalog.pricing import price
from catalog.rendering import prompt_fragments, prompt_token_ids
from conftest import make_customer, make_host
from hosts.models import Host
from marketplace import services, tasks
from marketplace.hostdoor import claiming
from marketplace.models import Job, PrefixBlock, Request
from marketplace.openai.choices import admit_choices
from marketplace.openai.render import response_body, usage_chunk
from marketplace.tests.test_e2e import client, served  # noqa: F401  (the fixture)
from marketplace.tests.test_routing import beat
from marketplace.trust import prefixes
from testkit.evidence import drawn
from testkit.requests import submit_request

if TYPE_CHECKING:
    from testkit.personas import Customer, ServingHost

pytestmark = pytest.mark.django_db(transaction=True)  # the claims' long-polls read through database threads

MODEL = "gemma-3-270m"
SYSTEM = "You are the support assistant of a small bakery in Lyon. Answer briefly, kindly and in English. " * 12
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Sundays?"}]
REPLY = "At eight, until noon."
FOLLOW_UP = [*FIRST, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "And on Mondays?"}]


def admit(customer: Customer, messages: list[dict], *, kind: str = Request.Kind.CHAT) -> Request:
    """One request through the real admission (rendered, counted, hashed, looked up, routed, held)."""
    body = {"model": MODEL, "max_tokens": 8, **({"messages": messages} if kind == Request.Kind.CHAT else {})}
    if kind == Request.Kind.COMPLETION:
        body["prompt"] = messages[0]["content"]

    async def go() -> Request:
        choices = await admit_choices(secret=customer.secret, kind=kind, body=body)
        for choice in choices:
            await choice.listener.close()
        return choices[0].row

    return asyncio.run(go())


def claim(serving: ServingHost) -> dict | None:
    """A claim at the host door (where the claimed job's blocks are recorded for the host)."""
    serving.host.refresh_from_db()
    return asyncio.run(claiming.claim_when_offered(serving.host, fingerprint=serving.fingerprint, wait=0.3))


def answer(serving: ServingHost, job_id: int, text: str = REPLY) -> None:
    services.job_push_tokens(host=serving.host, job_id=job_id, seq=0, text=text)
    services.job_complete(host=serving.host, job_id=job_id, finish_reason="stop", token_ids=drawn(job_id))


def serve(request: Request, hosts: list[ServingHost]) -> ServingHost:
    """The host the request was offered to claims it and answers: returns that host."""
    offered = Job.objects.get(request=request).offered_host_id
    serving = next(s for s in hosts if s.host.pk == offered)
    payload = claim(serving)
    assert payload is not None
    answer(serving, payload["id"])
    return serving


def expected_cached(model: CatalogModel, before: list[dict], now: list[dict]) -> int:
    """What the gateway should find held: the whole blocks the earlier prompt shares with this one."""
    ids = [
        prompt_token_ids(model, prompt_fragments(model, kind="chat", messages=m, prompt=None)) for m in (before, now)
    ]
    shared = next((i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), min(map(len, ids)))
    size = 64
    return min(shared // size * size, len(ids[1]) - 1)


@pytest.fixture
def pair(catalog: CatalogModel) -> list[ServingHost]:
    """Two warm hosts with two usable slots each."""
    hosts = [make_host(name="left"), make_host(name="right")]
    for serving in hosts:
        beat(serving, loaded=[MODEL], slots=2)
    Host.objects.filter(pk__in=[s.host.pk for s in hosts]).update(trusted_at=timezone.now())
    return hosts


def busy(serving: ServingHost, catalog: CatalogModel) -> None:
    """One job running on the host, from a stranger: it is the busier of the two."""
    job = Job.objects.get(request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3))
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, host=serving.host, offered_host=None)


class TestFollowUpTurn:
    def test_it_lands_on_the_host_that_served_the_turn_before_and_pays_the_cached_price_everywhere(
        self, catalog, customer, pair
    ) -> None:
        first = admit(customer, FIRST)
        assert first.cached_tokens == 0
        holder = serve(first, pair)
        other = next(s for s in pair if s is not holder)
        busy(holder, catalog)  # without the prefix, least-connections would offer the other host
        follow = admit(customer, FOLLOW_UP)
        job = Job.objects.get(request=follow)
        assert job.offered_host_id == holder.host.pk != other.host.pk
        cached = expected_cached(catalog, FIRST, FOLLOW_UP)
        assert cached >= 128 and cached % 64 == 0
        assert follow.cached_tokens == cached, "the gateway's own count of the prefix it routed"
        held = price(catalog, prompt_tokens=follow.prompt_tokens, completion_tokens=8, cached_tokens=cached)
        assert follow.estimate_ucents == held < price(catalog, prompt_tokens=follow.prompt_tokens, completion_tokens=8)
        follow.hold.refresh_from_db()
        assert follow.hold.amount_ucents == held
        payload = claim(holder)
        assert payload["id"] == job.pk
        answer(holder, job.pk)
        follow.refresh_from_db()
        assert follow.cost_ucents == price(
            catalog,
            prompt_tokens=follow.prompt_tokens,
            completion_tokens=follow.completion_tokens,
            cached_tokens=cached,
        )
        quarter = -(-cached * catalog.input_price_ucents // 4)
        uncached = (follow.prompt_tokens - cached) * catalog.input_price_ucents
        assert follow.cost_ucents == uncached + quarter + follow.completion_tokens * catalog.output_price_ucents
        usage = response_body(follow, text=REPLY)["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
        assert (
            ChatCompletion.model_validate(response_body(follow, text=REPLY)).usage.prompt_tokens_details.cached_tokens
            == cached
        )
        chunk = ChatCompletionChunk.model_validate(usage_chunk([follow]))
        assert chunk.usage.prompt_tokens_details.cached_tokens == cached
        from marketplace.openai.apis import generation_body

        assert generation_body(follow)["cached_tokens"] == cached, "GET /v1/generation reports it too"

    def test_the_operators_cached_price_is_the_one_billed(self, catalog, customer, pair) -> None:
        CatalogModel.objects.filter(pk=catalog.pk).update(cached_input_price_ucents=1)
        serve(admit(customer, FIRST), pair)
        follow = admit(customer, FOLLOW_UP)
        cached = follow.cached_tokens
        assert cached > 0
        catalog.refresh_from_db()
        expected = (
            (follow.prompt_tokens - cached) * catalog.input_price_ucents + cached * 1 + 8 * catalog.output_price_ucents
        )
        assert follow.estimate_ucents == expected

    def test_another_account_sending_the_same_prompt_gets_nothing_cached(self, catalog, customer, pair) -> None:
        serve(admit(customer, FIRST), pair)
        stranger = make_customer()
        theirs = admit(stranger, FOLLOW_UP)
        assert theirs.cached_tokens == 0
        assert theirs.estimate_ucents == price(catalog, prompt_tokens=theirs.prompt_tokens, completion_tokens=8)
        assert response_body(theirs, text="")["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    def test_a_text_completion_reports_its_cached_prompt_as_openais_client_reads_it(
        self, catalog, customer, pair
    ) -> None:
        text = [{"content": SYSTEM + "Question one."}]
        serve(admit(customer, text, kind=Request.Kind.COMPLETION), pair)
        again = admit(customer, [{"content": SYSTEM + "Question two, rather longer."}], kind=Request.Kind.COMPLETION)
        assert again.cached_tokens >= 64
        body = Completion.model_validate(response_body(again, text=""))
        assert body.usage.prompt_tokens_details.cached_tokens == again.cached_tokens


class TestOnlyTheGatewayDecides:
    def test_a_host_not_offered_the_job_that_takes_it_leaves_the_cached_price_as_decided(
        self, catalog, customer, pair
    ) -> None:
        holder = serve(admit(customer, FIRST), pair)
        other = next(s for s in pair if s is not holder)
        follow = admit(customer, FOLLOW_UP)
        decided = follow.cached_tokens
        assert decided > 0
        Job.objects.filter(request=follow).update(offer_until=timezone.now() - timedelta(seconds=1))
        payload = claim(other)  # the offer lapsed: the host without the prefix takes it
        assert payload is not None
        answer(other, payload["id"])
        follow.refresh_from_db()
        assert follow.cached_tokens == decided, "the customer keeps the discount decided at admission"
        assert follow.cost_ucents == price(
            catalog,
            prompt_tokens=follow.prompt_tokens,
            completion_tokens=follow.completion_tokens,
            cached_tokens=decided,
        )

    def test_a_holder_taking_a_request_admitted_uncached_bills_it_uncached(self, catalog, customer, pair) -> None:
        holder = serve(admit(customer, FIRST), pair)
        stranger = make_customer()
        theirs = admit(stranger, FOLLOW_UP)
        Job.objects.filter(request=theirs).update(offered_host=holder.host)
        payload = claim(holder)
        answer(holder, payload["id"])
        theirs.refresh_from_db()
        assert theirs.cached_tokens == 0
        assert theirs.cost_ucents == price(
            catalog, prompt_tokens=theirs.prompt_tokens, completion_tokens=theirs.completion_tokens
        )

    def test_a_claim_records_the_blocks_for_the_account_model_and_host_it_was_routed_to(
        self, catalog, customer, pair
    ) -> None:
        first = admit(customer, FIRST)
        holder = serve(first, pair)
        rows = PrefixBlock.objects.filter(user=customer.user, model=catalog, host=holder.host)
        assert rows.count() == first.prompt_tokens // 64 == len(first.prefix_hashes)
        assert sorted(rows.values_list("tokens", flat=True)) == [64 * (i + 1) for i in range(rows.count())]


class TestForgotten:
    def test_after_the_bound_a_prefix_is_gone_and_the_tick_deletes_it(self, catalog, customer, pair, settings) -> None:
        settings.PROMPT_CACHE_SECONDS = 0.2
        serve(admit(customer, FIRST), pair)
        assert PrefixBlock.objects.exists()
        time.sleep(0.3)
        follow = admit(customer, FOLLOW_UP)
        assert follow.cached_tokens == 0
        tasks.watchdog_tick()
        assert not PrefixBlock.objects.exists()

    def test_a_claim_renews_a_prefix(self, catalog, customer, pair, settings) -> None:
        holder = serve(admit(customer, FIRST), pair)
        PrefixBlock.objects.update(expires_at=timezone.now() + timedelta(seconds=1))
        follow = admit(customer, FOLLOW_UP)
        claim(holder)
        assert PrefixBlock.objects.filter(host=holder.host).count() == len(follow.prefix_hashes)
        assert all(
            at > timezone.now() + timedelta(seconds=settings.PROMPT_CACHE_SECONDS - 5)
            for at in PrefixBlock.objects.values_list("expires_at", flat=True)
        )


class TestRules:
    def test_a_chain_hash_depends_on_every_block_before_it_and_the_model(self) -> None:
        ids = list(range(200))
        chain = prefixes.block_hashes(model_id=1, token_ids=ids)
        assert len(chain) == 3 and all(len(h) == 64 for h in chain)
        assert prefixes.block_hashes(model_id=1, token_ids=ids[:150]) == chain[:2]
        changed = prefixes.block_hashes(model_id=1, token_ids=[7, *ids[1:]])
        assert all(a != b for a, b in zip(changed, chain, strict=True))
        assert prefixes.block_hashes(model_id=2, token_ids=ids)[0] != chain[0]

    def test_a_cached_prefix_never_covers_the_whole_prompt(self) -> None:
        assert prefixes.cached_tokens(prefix_tokens=128, prompt_tokens=128) == 127
        assert prefixes.cached_tokens(prefix_tokens=64, prompt_tokens=300) == 64

    def test_the_default_cached_price_is_a_quarter_rounded_up_once(self, catalog) -> None:
        catalog.input_price_ucents, catalog.output_price_ucents = 10, 30
        assert price(catalog, prompt_tokens=100, completion_tokens=2, cached_tokens=65) == 35 * 10 + 163 + 60
        catalog.cached_input_price_ucents = 0
        assert price(catalog, prompt_tokens=100, completion_tokens=2, cached_tokens=65) == 35 * 10 + 60

    def test_embeddings_are_never_cached(self, customer) -> None:
        minilm = CatalogModel.objects.get(kind=CatalogModel.Kind.EMBEDDING)
        row = submit_request(customer, minilm, kind="embeddings", inputs=["a" * 400], max_tokens=0)
        assert row.cached_tokens == 0 and row.prefix_hashes is None


@pytest.mark.e2e
class TestEndToEnd:
    def test_the_openai_client_reads_a_follow_ups_cached_tokens_whole_and_streamed(
        self,
        gateway,
        served,  # noqa: F811
    ) -> None:
        customer, _, _ = served
        api = client(gateway, customer)
        first = api.chat.completions.create(model=MODEL, messages=FIRST, max_tokens=8, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        turn = [*FIRST, {"role": "assistant", "content": first.choices[0].message.content}]
        second = api.chat.completions.create(
            model=MODEL, messages=[*turn, {"role": "user", "content": "And on Mondays?"}], max_tokens=8, temperature=0
        )
        row = Request.objects.get(public_id=second.id)
        assert second.usage.prompt_tokens_details.cached_tokens == row.cached_tokens >= 128
        assert row.cost_ucents == price(
            row.model,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            cached_tokens=row.cached_tokens,
        )
        stream = api.chat.completions.create(
            model=MODEL,
            messages=[*turn, {"role": "user", "content": "And on Tuesdays?"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        assert usage.prompt_tokens_details.cached_tokens >= 128
