"""End to end: a small farm — one real chat host (Gemma 3 270M) and one real
embeddings host (all-MiniLM-L6-v2 on sentence-transformers) — behind one gateway
and one /v1/models, driven by the `openai` client."""

from __future__ import annotations

import math

import openai
import pytest

from billing.models import Account
from conftest import make_customer, make_host, wait_until
from marketplace.models import Job, Request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

SENTENCES = [
    "The elephant is a grey animal.",
    "Elephants are large grey mammals.",
    "The stock market fell sharply today.",
]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_one_catalog_two_kinds_of_host_each_request_on_the_right_one(gateway, catalog, start_mahout) -> None:
    chat_host = make_host(qualified=False, name="farm-chat")
    embeddings_host = make_host(qualified=False, name="farm-embeddings")
    start_mahout(chat_host.token)
    start_mahout(embeddings_host.token, extra=["--models", "all-minilm-l6-v2"])
    customer = make_customer()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=120)

    def listed() -> dict:
        models = {m.id: m for m in client.models.list().data}
        return models if {"gemma-3-270m", "all-minilm-l6-v2"} <= set(models) else {}

    models = wait_until(listed, timeout=20, what="both models in /v1/models", interval=0.5)
    assert models["all-minilm-l6-v2"].model_extra["kind"] == "embedding"
    assert models["gemma-3-270m"].model_extra["hosts_warm"] >= 1

    chat = client.chat.completions.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content

    result = client.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES)
    vectors = [item.embedding for item in result.data]
    assert [item.index for item in result.data] == [0, 1, 2] and all(len(v) == 384 for v in vectors)
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
    assert result.usage.prompt_tokens > len(SENTENCES)

    row = Request.objects.get(kind="embeddings")
    assert row.cost_ucents == row.prompt_tokens * row.model.input_price_ucents == result.usage.prompt_tokens * 2
    assert row.inputs is None and row.result is None, "neither the texts nor the vectors are kept"
    job = Job.objects.get(request=row)
    assert job.host_id == embeddings_host.host.pk and job.earned_ucents == row.cost_ucents * 80 // 100
    assert Job.objects.get(request__kind="chat").host_id == chat_host.host.pk
    assert Account.objects.get(kind="host", host=embeddings_host.host).balance_ucents == job.earned_ucents

    single = client.embeddings.create(model="all-minilm-l6-v2", input="A grey giant.", encoding_format="float")
    assert len(single.data) == 1 and len(single.data[0].embedding) == 384
