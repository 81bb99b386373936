"""Bad input gets a 4xx in OpenAI's error format, never a 500, never a hold left behind."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from accounts.services import api_key_revoke
from billing.models import Hold
from conftest import make_customer
from marketplace.models import Job, Request
from testkit.evidence import drawn

if TYPE_CHECKING:
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse

    from testkit.personas import Customer

pytestmark = pytest.mark.django_db(transaction=True)  # views run ORM calls on their own threads

GOOD = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def post(
    client: Client, secret: str | None, body: object, path: str = "/v1/chat/completions", raw: bytes | None = None
) -> TestResponse:
    headers = {"HTTP_AUTHORIZATION": f"Bearer {secret}"} if secret else {}
    data = raw if raw is not None else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", **headers)


def assert_error(response: TestResponse, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code
    assert len(error["message"]) > 10
    return error


@pytest.fixture
def api(customer: Customer) -> tuple[Client, str]:
    return Client(), customer.secret


BAD_BODIES = [
    ({**GOOD, "max_tokens": -1}, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": 10**9}, "max_tokens"),
    ({**GOOD, "max_tokens": "many"}, "max_tokens"),
    ({**GOOD, "temperature": 7}, "temperature"),
    ({**GOOD, "messages": []}, "messages"),
    ({**GOOD, "messages": "hello"}, "messages"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({**GOOD, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**GOOD, "messages": [{"role": "system", "content": "only system"}]}, "messages"),
    ({**GOOD, "n": 0}, "n"),  # (n > 1 is unsupported_parameter: test_openai_surface)
    ({**GOOD, "stop": [""]}, "stop"),
    ({k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ({k: v for k, v in GOOD.items() if k != "messages"}, "messages"),
]


class BadInputTests:
    @pytest.mark.parametrize(("body", "param"), BAD_BODIES)
    def test_it_names_the_bad_field(self, api, body, param) -> None:
        client, secret = api
        error = assert_error(post(client, secret, body), 400, "invalid_value")
        assert error["param"] == param
        assert not Hold.objects.exists() and not Job.objects.exists()

    def test_malformed_json_is_a_400(self, api) -> None:
        client, secret = api
        assert_error(post(client, secret, None, raw=b"{not json"), 400, "invalid_json")
        assert_error(post(client, secret, [1, 2]), 400, "invalid_json")

    @pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
    def test_a_number_that_is_not_finite_is_a_400_before_any_host_sees_it(self, api, constant) -> None:
        client, secret = api  # Python's JSON reader accepts these; a runner given one fails (and was its host's strike)
        raw = json.dumps({**GOOD, "temperature": 0.5}).replace("0.5", constant).encode()
        error = assert_error(post(client, secret, None, raw=raw), 400, "invalid_json")
        assert constant in error["message"]
        assert not Job.objects.exists()

    def test_an_unknown_model_is_a_404(self, api) -> None:
        client, secret = api
        assert_error(post(client, secret, {**GOOD, "model": "gpt-9"}), 404, "model_not_found")

    def test_an_oversized_body_is_a_413(self, api, settings) -> None:
        client, secret = api
        big = {**GOOD, "messages": [{"role": "user", "content": "x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 10)}]}
        assert_error(post(client, secret, big), 413, "body_too_large")

    def test_a_prompt_past_the_context_is_refused_before_queueing(self, api) -> None:
        client, secret = api
        long = {**GOOD, "max_tokens": 4000, "messages": [{"role": "user", "content": "elephant " * 400}]}
        assert_error(post(client, secret, long), 400, "context_length_exceeded")
        assert not Request.objects.exists()

    def test_missing_wrong_and_revoked_keys_are_401(self, api, customer) -> None:
        client, _ = api
        assert_error(post(client, None, GOOD), 401, "missing_api_key")
        assert_error(post(client, "el-nope", GOOD), 401, "invalid_api_key")
        api_key_revoke(key=customer.key)
        assert_error(post(client, customer.secret, GOOD), 401, "invalid_api_key")
        assert_error(client.get("/v1/credits", HTTP_AUTHORIZATION=f"Bearer {customer.secret}"), 401, "invalid_api_key")

    def test_completions_validate_the_prompt(self, api) -> None:
        client, secret = api
        body = {"model": "gemma-3-270m", "prompt": "", "max_tokens": 4}
        error = assert_error(post(client, secret, body, path="/v1/completions"), 400, "invalid_value")
        assert error["param"] == "prompt"

    def test_generation_needs_an_id_that_is_yours(self, api, catalog) -> None:
        client, secret = api
        other = make_customer()
        auth = {"HTTP_AUTHORIZATION": f"Bearer {secret}"}
        assert_error(client.get("/v1/generation", **auth), 400, "missing_id")
        assert_error(client.get("/v1/generation?id=chatcmpl-unknown", **auth), 404, "not_found")
        from django.db import transaction

        from billing.services import hold_place

        with transaction.atomic():
            hold = hold_place(user=other.user, api_key=other.key, amount_ucents=0)
            Request.objects.create(
                public_id="chatcmpl-theirs",
                user=other.user,
                api_key=other.key,
                model=catalog,
                kind="chat",
                params={},
                hold=hold,
            )
        assert_error(client.get("/v1/generation?id=chatcmpl-theirs", **auth), 404, "not_found")


class HostApiInputTests:
    def test_bad_host_input_is_a_clear_4xx(self, serving_host) -> None:
        client = Client()
        auth = {"HTTP_AUTHORIZATION": f"Bearer {serving_host.token}"}
        assert_error(
            client.post("/hosts/api/claim", data="{", content_type="application/json", **auth), 400, "invalid_json"
        )
        assert_error(
            client.post("/hosts/api/claim", data=json.dumps({"wait": 1}), content_type="application/json", **auth),
            400,
            "invalid_value",
        )
        assert_error(
            client.post(
                "/hosts/api/jobs/1/tokens",
                data=json.dumps({"seq": -1, "text": "x"}),
                content_type="application/json",
                **auth,
            ),
            400,
            "invalid_value",
        )
        assert_error(
            client.post("/hosts/api/claim", data=json.dumps({"fingerprint": "x"}), content_type="application/json"),
            401,
            "missing_api_key",
        )
        assert_error(
            client.post(
                "/hosts/api/heartbeat",
                data=json.dumps({"fingerprint": "x"}),
                content_type="application/json",
                HTTP_AUTHORIZATION="Bearer host-nope",
            ),
            401,
            "invalid_host_token",
        )
        bad_model = {
            "model": "nope",
            "fingerprint": "x",
            "benchmark": {"prompt_tps": 1, "gen_tps": 1, "ttft_ms": 1, "memory_mb": 1},
        }
        assert_error(
            client.post(
                "/hosts/api/qualifications", data=json.dumps(bad_model), content_type="application/json", **auth
            ),
            404,
            "model_not_found",
        )
        unmeasured = {**bad_model, "model": "gemma-3-270m", "benchmark": {**bad_model["benchmark"], "gen_tps": 0}}
        assert_error(
            client.post(
                "/hosts/api/qualifications", data=json.dumps(unmeasured), content_type="application/json", **auth
            ),
            400,
            "invalid_value",
        )


class HostMeTests:
    def test_it_shows_the_host_its_own_state_and_qualifications(self, serving_host) -> None:
        answer = Client().get("/hosts/api/me", HTTP_AUTHORIZATION=f"Bearer {serving_host.token}")
        assert answer.status_code == 200
        body = answer.json()
        assert body["name"] == serving_host.host.name and body["active_jobs"] == []
        assert [q["model"] for q in body["qualifications"]] == ["gemma-3-270m"]
        earnings = Client().get("/hosts/api/earnings", HTTP_AUTHORIZATION=f"Bearer {serving_host.token}").json()
        assert earnings == {
            "balance_ucents": 0,
            "payable_ucents": 0,
            "unvested_ucents": 0,
            "today_ucents": 0,
            "lines": [],
        }


@pytest.mark.django_db(transaction=True)
class UnconfirmedEmailTests:
    def test_a_key_of_an_account_whose_address_is_not_confirmed_cannot_spend(self, catalog) -> None:
        from django.utils import timezone

        from accounts.models import EmailVerification

        customer = make_customer()
        EmailVerification.objects.create(user=customer.user)  # signed up, link not opened yet
        client = Client()
        error = assert_error(post(client, customer.secret, {**GOOD, "model": "gpt-9"}), 403, "email_unverified")
        assert customer.user.email in error["message"]
        assert client.get("/v1/credits", HTTP_AUTHORIZATION=f"Bearer {customer.secret}").status_code == 200, (
            "reading is allowed"
        )
        assert not Request.objects.exists() and not Hold.objects.exists()
        EmailVerification.objects.filter(user=customer.user).update(verified_at=timezone.now())
        assert_error(
            post(client, customer.secret, {**GOOD, "model": "gpt-9"}), 404, "model_not_found"
        )  # past the check now


@pytest.mark.django_db
class HostEarningsTodayTests:
    def test_today_counts_the_work_finished_since_midnight_utc(self, customer, serving_host, catalog) -> None:
        from datetime import timedelta

        from django.utils import timezone

        from marketplace import services
        from marketplace.models import Job
        from marketplace.tests.test_reputation import claim, online
        from testkit.requests import CHAT, submit_request

        online(serving_host)
        done = []
        for _ in range(2):
            submit_request(
                customer, catalog, messages=CHAT, stream=True, max_tokens=8, temperature=1.0, response_format=None
            )
            job = claim(serving_host)
            services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there")
            done.append(
                services.job_complete(
                    host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
                ).earned_ucents
            )
        yesterday = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(seconds=1)
        Job.objects.filter(pk=job.pk).update(finished_at=yesterday)
        earnings = Client().get("/hosts/api/earnings", HTTP_AUTHORIZATION=f"Bearer {serving_host.token}").json()
        assert done[0] > 0 and earnings["today_ucents"] == done[0]
        assert earnings["balance_ucents"] == sum(done)
