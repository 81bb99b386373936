"""The live API against its own schema (/api/schema/), and tenants against each other.

Schemathesis sends every operation of the schema its examples, boundary cases and
generated requests, valid and not, with a customer's key or a host's token (as each
operation's security names), to a real gateway (daphne) on the test database; a simulated
host serves the shipped models, Stripe is a local fake. No answer may be a server error
(5xx), carry a status the operation does not document, or break the documented shape.

Then the tenant crossings on the same stack: a customer's request ids with another
customer's key, a host's running job with another host's token, and no credential at all.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.engine import events, from_schema

from billing.stripe_local import LocalStripe
from conftest import Customer, Gateway, ServingHost, make_customer, make_host, stack_env, wait_until
from marketplace.tests.test_routing_sim import Sim
from testkit.evidence import drawn

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pytest_django import DjangoDbBlocker

    from catalog.models import CatalogModel

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

EXAMPLES = 25  # generated requests per operation, besides its examples and coverage cases
SEED = int(os.environ.get("FUZZ_SEED") or random.randrange(2**32))  # FUZZ_SEED=N replays a run
CHECKS = ("no_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance")
EMBEDDER = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def fuzz_gateway(
    django_db_setup: None, django_db_blocker: DjangoDbBlocker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    stripe = LocalStripe().start()
    with django_db_blocker.unblock():
        env = stack_env(
            {
                "STRIPE_SECRET_KEY": "sk_test_local",
                "STRIPE_WEBHOOK_SECRET": "whsec_test_fuzz",
                "STRIPE_API_BASE": stripe.url,
                "STRIPE_MAX_RETRIES": "0",
                "QUEUE_TIMEOUT_SECONDS": "10",
                "MODEL_LIST_CACHE_SECONDS": "0",
                "ROUTING_COLD_GRACE_SECONDS": "0",
                # The simulated host fails every structured answer asked of it (it runs no model: see
                # no_server_error), more than the 5 an hour after which a host is rested as unreliable;
                # rested, it would leave every later generation to time out (504).
                "HOST_MAX_FAILURES_PER_HOUR": "100000",
            }
        )
    gateway = Gateway(env, tmp_path_factory.mktemp("fuzz-logs"))
    yield gateway
    gateway.stop()
    stripe.stop()


@dataclass
class Tenants:
    customer: Customer
    other_customer: Customer
    host: ServingHost
    other_host: ServingHost


@pytest.fixture
def tenants(catalog: CatalogModel) -> Tenants:
    """Two customers and two hosts; the hosts qualified nothing, so no customer's job goes to them."""
    return Tenants(
        customer=make_customer(),
        other_customer=make_customer(),
        host=make_host(qualified=False),
        other_host=make_host(qualified=False, name="other"),
    )


@pytest.fixture
def serving(fuzz_gateway: Gateway, catalog: CatalogModel) -> Iterator[Sim]:
    """A simulated host serving the shipped chat and embeddings models (its vectors have 3 dimensions)."""
    from catalog.models import CatalogModel

    CatalogModel.objects.filter(name=EMBEDDER).update(embedding_dimensions=3)
    sim = Sim(fuzz_gateway.url, catalog.name, "sim", ["--model", EMBEDDER, "--slots", "2", "--wait", "2"])
    yield sim
    sim.stop()


@schemathesis.check
def no_server_error(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """Schemathesis's `not_a_server_error`, but for the 502 the simulated host earns on purpose: it
    runs no model, so its answer to a request with a `response_format` (or a required tool call,
    which is one) is not the JSON asked for, and the gateway refuses to pass it off as an answer
    (invalid_structured_output, nothing billed). A host that honours them is
    marketplace/tests/test_structured_output.py's and test_tools_logprobs_choices.py's."""
    body = case.body if isinstance(case.body, dict) else {}
    asks_json = body.get("response_format") or (
        body.get("tools") and body.get("tool_choice") not in (None, "auto", "none")
    )
    code = _error_code(response) if response.status_code == 502 else None
    if asks_json and code == "invalid_structured_output":
        return True
    # The fuzzer is a host too (its token): among its generated requests it may qualify itself,
    # claim a customer's job and fail it or leave it. The customer then gets the documented 502
    # in the API's error format (`host_failed`, or another host-side refusal): the hosts' doing,
    # not the gateway's. A gateway fault is a 500, and any other 5xx still fails, with its body.
    if code is not None:
        return True
    if response.status_code >= 500:
        raise AssertionError(f"{response.status_code}: {response.text[:300]}")
    return not_a_server_error(ctx, response, case)


def _error_code(response: schemathesis.Response) -> str | None:
    try:
        return (response.json().get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


def fuzz(url: str, tenants: Tenants) -> tuple[Counter, list[str]]:
    """Run schemathesis's engine (what its CLI runs) over the whole schema: the statuses
    answered, by operation and status, and every failed check or error, described."""
    config = schemathesis.Config.from_dict(
        {
            "base-url": url,
            "request-timeout": 30,
            "seed": SEED,
            "generation": {"max-examples": EXAMPLES},
            "phases": {"stateful": {"enabled": False}},
            "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
            "auth": {
                "openapi": {"ApiKey": {"bearer": tenants.customer.secret}, "HostToken": {"bearer": tenants.host.token}}
            },
        }
    )
    schema = schemathesis.openapi.from_url(f"{url}/api/schema/", config=config)
    answered: Counter = Counter()
    problems: list[str] = []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            recorder = event.recorder
            for interaction in recorder.interactions.values():
                answered[(recorder.label, interaction.response.status_code if interaction.response else None)] += 1
            for case_id, checks in recorder.checks.items():
                problems += [
                    f"{recorder.label}: {check.name}: {check.failure_info.failure.title} "
                    f"({check.failure_info.failure.message[:300]})\n"
                    f"{recorder.cases[case_id].value.as_curl_command()}"
                    for check in checks
                    if check.failure_info
                ]
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            problems.append(f"{getattr(event, 'label', '')}: {getattr(event, 'info', None) or event}")
    return answered, problems


def test_every_operation_answers_as_documented_and_never_with_a_server_error(fuzz_gateway, tenants, serving) -> None:
    started = time.monotonic()
    answered, problems = fuzz(fuzz_gateway.url, tenants)
    operations = {label for label, _ in answered}
    by_status: Counter = Counter()
    for (_, code), n in answered.items():
        by_status[code] += n
    print(
        f"schemathesis (FUZZ_SEED={SEED}): {sum(answered.values())} requests to {len(operations)} operations in "
        f"{time.monotonic() - started:.0f} s; by status: {dict(sorted(by_status.items(), key=str))}"
    )
    assert not problems, f"FUZZ_SEED={SEED}\n\n" + "\n\n".join(problems[:20])
    assert len(operations) >= 36, sorted(operations)  # every operation was called
    assert None not in by_status  # every request was answered
    assert any(
        label == "POST /v1/chat/completions" and code == 200 for label, code in answered
    )  # the examples were served


# --- tenants ------------------------------------------------------------------------------


def bearer(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


@pytest.fixture
def running(fuzz_gateway: Gateway, tenants: Tenants) -> Iterator[tuple[str, int]]:
    """A completion of `tenants.customer`, running on `tenants.host` (the only host that
    qualified its model): its public id and its job id. The host completes it at the end."""
    from catalog.models import CatalogModel
    from marketplace.models import Request

    model = CatalogModel.objects.create(
        name=f"tenancy-{uuid.uuid4().hex[:6]}",
        context_length=4096,
        input_price_ucents=10,
        output_price_ucents=40,
        tokenizer="bytes",
    )
    url, host = fuzz_gateway.url, tenants.host
    benchmark = {"prompt_tps": 100.0, "gen_tps": 40.0, "ttft_ms": 10.0, "memory_mb": 1.0}
    qualified = httpx.post(
        f"{url}/hosts/api/qualifications",
        headers=bearer(host.token),
        timeout=10,
        json={"model": model.name, "fingerprint": host.fingerprint, "benchmark": benchmark},
    )
    assert qualified.status_code == 201, qualified.text
    beat = httpx.post(
        f"{url}/hosts/api/heartbeat", headers=bearer(host.token), timeout=10, json={"fingerprint": host.fingerprint}
    )
    assert beat.status_code == 200, beat.text  # only a present host may claim
    answer: dict[str, httpx.Response] = {}
    asking = threading.Thread(
        target=lambda: answer.setdefault(
            "response",
            httpx.post(
                f"{url}/v1/completions",
                headers=bearer(tenants.customer.secret),
                timeout=30,
                json={"model": model.name, "prompt": "Hello", "max_tokens": 4},
            ),
        )
    )
    asking.start()
    claim = httpx.post(
        f"{url}/hosts/api/claim",
        headers=bearer(host.token),
        timeout=30,
        json={"fingerprint": host.fingerprint, "wait": 10},
    )
    assert claim.status_code == 200, claim.text
    job_id = claim.json()["job"]["id"]
    public_id = wait_until(
        lambda: Request.objects.filter(user=tenants.customer.user).values_list("public_id", flat=True).first(),
        timeout=10,
        what="the request",
    )
    yield public_id, job_id
    pushed = httpx.post(
        f"{url}/hosts/api/jobs/{job_id}/tokens", headers=bearer(host.token), json={"seq": 0, "text": " world"}
    )
    done = httpx.post(
        f"{url}/hosts/api/jobs/{job_id}/complete",
        headers=bearer(host.token),
        json={"finish_reason": "stop", "tokens": drawn(job_id)},
    )
    asking.join(30)
    assert (pushed.status_code, done.status_code) == (200, 200), (pushed.text, done.text)
    assert answer["response"].json()["choices"][0]["text"] == " world"


def status(method: str, url: str, secret: str | None, body: dict | None = None) -> int:
    return httpx.request(method, url, headers=bearer(secret), json=body, timeout=10).status_code


def test_customer_ids_are_not_found_with_another_key_and_refused_without_one(fuzz_gateway, tenants, running) -> None:
    public_id, _ = running
    url = fuzz_gateway.url
    generation = f"{url}/v1/generation?id={public_id}"
    resume = f"{url}/v1/completions/{public_id}?stream=true&starting_after=999999"  # the owner: past what was delivered
    statuses = {
        who: (status("GET", generation, secret), status("GET", resume, secret))
        for who, secret in {
            "owner": tenants.customer.secret,
            "other customer": tenants.other_customer.secret,
            "host": tenants.host.token,
            "other host": tenants.other_host.token,
            "anonymous": None,
        }.items()
    }
    assert statuses == {
        "owner": (200, 400),
        "other customer": (404, 404),
        "host": (401, 401),
        "other host": (401, 401),
        "anonymous": (401, 401),
    }
    other = httpx.get(generation, headers=bearer(tenants.other_customer.secret), timeout=10).json()
    assert other["error"]["code"] == "not_found" and "status" not in other  # nothing of the request leaks


def test_a_hosts_job_is_refused_to_another_host_to_customers_and_without_a_token(
    fuzz_gateway, tenants, running
) -> None:
    _, job_id = running
    jobs = f"{fuzz_gateway.url}/hosts/api/jobs/{job_id}"
    calls = {
        "tokens": {"seq": 0, "text": "stolen"},
        "progress": {"stage": "prefill"},
        "complete": {"finish_reason": "stop"},
        "fail": {"reason": "stolen"},
    }
    for who, secret, expected in (
        ("other host", tenants.other_host.token, 403),
        ("owner customer", tenants.customer.secret, 401),
        ("other customer", tenants.other_customer.secret, 401),
        ("anonymous", None, 401),
    ):
        assert {name: status("POST", f"{jobs}/{name}", secret, body) for name, body in calls.items()} == dict.fromkeys(
            calls, expected
        ), who
    assert (
        status("POST", f"{jobs}/progress", tenants.host.token, calls["progress"]) == 200
    )  # still its owner's, still running
