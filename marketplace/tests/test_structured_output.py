"""Structured output (`response_format`): the host samples under a grammar; the gateway
refuses a schema no host can follow and never passes on an answer that does not meet it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import jsonschema
import openai
import pytest

from billing.models import Hold
from conftest import make_customer, make_host
from marketplace import services
from marketplace.lifecycle.structured import answer_problem, schema_problem
from marketplace.models import Job, Request
from marketplace.tests.test_apis import GOOD, assert_error, post
from marketplace.tests.test_reputation import claim, online
from testkit.evidence import drawn
from testkit.requests import CHAT, submit_request

if TYPE_CHECKING:
    from collections.abc import Callable

    from testkit.stack import Gateway, Mahout

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


class SchemaTests:
    def test_what_can_and_cannot_constrain_an_answer(self) -> None:
        assert schema_problem(PERSON) is None
        assert "not valid" in schema_problem({"type": "nonsense"})
        assert "linear time" in schema_problem(
            {"type": "string", "pattern": "(?<=a)b"}
        )  # RE2 (and llama.cpp) refuse it
        assert "grammar" in schema_problem(
            {"type": "string", "pattern": "^a(?:b)$"}
        )  # RE2 takes it, llama.cpp's converter not

    def test_an_answer_is_checked_against_the_format(self) -> None:
        person = {"type": "json_schema", "name": "person", "schema": PERSON}
        assert answer_problem(None, "free text") is None
        assert answer_problem(person, '{"name": "Ada", "age": 36}') is None
        assert "not JSON" in answer_problem(person, "Ada, 36")
        assert "the required property 'age' is missing" in answer_problem(person, '{"name": "Ada"}')
        assert answer_problem({"type": "json_object"}, '{"a": [1, 2]}') is None
        assert "not an object" in answer_problem({"type": "json_object"}, "[1, 2]")

    @pytest.mark.parametrize(
        ("response_format", "answer"),
        [
            ({"type": "json_schema", "name": "person", "schema": PERSON}, '{"name": "my diary", "age": "my diary"}'),
            ({"type": "json_schema", "name": "person", "schema": PERSON}, '{"name": "Ada", "age": 1, "my diary": 2}'),
            ({"type": "json_schema", "name": "s", "schema": {"type": "string", "enum": ["a"]}}, '"my diary"'),
            ({"type": "json_schema", "name": "person", "schema": PERSON}, "my diary"),
            ({"type": "json_object"}, '"my diary"'),
            ({"type": "json_schema", "name": "person", "schema": PERSON}, "[" * 100_000),
        ],
    )
    def test_a_refusal_describes_the_answer_without_quoting_it(self, response_format, answer) -> None:
        """The reason outlives the answer (Request.error_message, Job.fail_reason): none of the answer's words in it."""
        problem = answer_problem(response_format, answer)
        assert problem and "diary" not in problem


@pytest.mark.django_db(transaction=True)  # the API views are async: their database threads must see the rows
class ValidationTests:
    @pytest.mark.parametrize(
        "value",
        [
            {"type": "xml"},
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"schema": PERSON}},
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}},
            "json",
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "(?<=a)b"}}},
        ],
    )
    def test_a_format_no_host_could_follow_is_a_400_naming_it(self, customer, value) -> None:
        from django.test import Client

        error = assert_error(post(Client(), customer.secret, {**GOOD, "response_format": value}), 400, "invalid_value")
        assert error["param"] == "response_format", error

    @pytest.mark.parametrize("value", [{"type": "text"}, {"type": "json_object"}, AS_SCHEMA, None])
    def test_a_followable_format_passes_validation(self, customer, value) -> None:
        from django.test import Client

        response = post(Client(), customer.secret, {**GOOD, "model": "gpt-9", "response_format": value})
        assert_error(response, 404, "model_not_found")  # past validation: the unknown model answers


@pytest.mark.django_db
class HostAnswerTests:
    def submit(self, catalog, response_format: dict) -> Request:  # noqa: ANN001
        return submit_request(
            make_customer(), catalog, messages=CHAT, stream=True, max_tokens=40, response_format=response_format
        )

    def test_an_answer_that_breaks_the_schema_is_the_hosts_failure_and_nobody_pays(self, serving_host, catalog) -> None:
        online(serving_host)
        request = self.submit(catalog, {"type": "json_schema", "name": "person", "schema": PERSON})
        job = claim(serving_host)
        assert (
            job.request_id == request.pk and services.job_payload(job)["params"]["response_format"]["schema"] == PERSON
        )
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text='{"name": "Ada"}')
        done = services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
        )
        assert done.earned_ucents == 0
        request.refresh_from_db()
        assert (request.status, request.error_code, request.cost_ucents) == (
            Request.Status.FAILED,
            "invalid_structured_output",
            0,
        )
        assert "the required property 'age' is missing" in request.error_message
        assert Job.objects.get(pk=job.pk).status == Job.Status.FAILED
        assert Hold.objects.get(pk=request.hold_id).status == Hold.Status.RELEASED
        assert not Request.objects.filter(status=Request.Status.RUNNING).exists()

    def test_a_refused_answer_leaves_no_quote_of_itself_behind(self, serving_host, catalog) -> None:
        online(serving_host)
        request = self.submit(catalog, {"type": "json_schema", "name": "person", "schema": PERSON})
        job = claim(serving_host)
        services.job_push_tokens(
            host=serving_host.host, job_id=job.pk, seq=0, text='{"name": "Ada", "age": "secret diary"}'
        )
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        request.refresh_from_db()
        assert request.error_code == "invalid_structured_output" and "'type' rule" in request.error_message
        assert (
            "secret diary" not in request.error_message and "secret diary" not in Job.objects.get(pk=job.pk).fail_reason
        )

    def test_the_answer_is_checked_before_settlement_takes_its_locks(self, serving_host, catalog, monkeypatch) -> None:
        from marketplace.lifecycle import settlement, structured

        online(serving_host)
        self.submit(catalog, {"type": "json_schema", "name": "person", "schema": PERSON})
        job = claim(serving_host)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text='{"name": "Ada", "age": 36}')
        checked, settle = structured._answer_problem, settlement.job_settle
        settling: list[bool] = []
        inside: list[bool] = []

        def watched(response_format, text):  # noqa: ANN001, ANN202
            inside.append(bool(settling))
            return checked(response_format, text)

        def settled(**kwargs):  # noqa: ANN003, ANN202 (the locks are taken in here)
            settling.append(True)
            return settle(**kwargs)

        monkeypatch.setattr(structured, "_answer_problem", watched)
        monkeypatch.setattr(settlement, "job_settle", settled)
        structured._verdict.cache_clear()
        assert (
            services.job_complete(
                host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
            ).earned_ucents
            > 0
        )
        assert inside == [False] and settling, "validated once, before the settlement's transaction"

    def test_an_answer_that_meets_it_settles_and_its_format_is_forgotten(self, serving_host, catalog) -> None:
        online(serving_host)
        request = self.submit(catalog, {"type": "json_object"})
        job = claim(serving_host)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text='{"name": "Ada", "age": 36}')
        assert (
            services.job_complete(
                host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
            ).earned_ucents
            > 0
        )
        request.refresh_from_db()
        assert request.status == Request.Status.COMPLETED and request.cost_ucents > 0

    def test_an_answer_cut_by_max_tokens_is_left_as_it_is(self, serving_host, catalog) -> None:
        online(serving_host)
        request = self.submit(catalog, {"type": "json_object"})
        job = claim(serving_host)
        text = '{"name": "' + "a " * 30
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=text)
        services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="length", token_ids=drawn(job.pk, ended=False)
        )
        request.refresh_from_db()
        assert (request.status, request.finish_reason) == (Request.Status.COMPLETED, "length")


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
class RealHostTests:
    def test_the_shipped_model_answers_json_that_parses_and_validates_whole_and_streamed(
        self,
        gateway: Gateway,
        catalog,
        start_mahout: Callable[..., Mahout],  # noqa: ANN001
    ) -> None:
        start_mahout(make_host(qualified=False, name="json-rig").token)
        api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=make_customer().secret, max_retries=0, timeout=90)
        ask = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
        whole = api.chat.completions.create(
            model="gemma-3-270m", messages=ask, max_tokens=60, temperature=0, response_format=AS_SCHEMA
        )
        assert whole.choices[0].finish_reason == "stop", whole
        jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in api.chat.completions.create(
                model="gemma-3-270m", messages=ask, max_tokens=60, temperature=0, response_format=AS_SCHEMA, stream=True
            )
            if chunk.choices
        )
        # (not asserted equal to the whole answer: the host reuses its prompt cache, and on some CPUs
        # llama.cpp's batched and one-token kernels differ enough to move a greedy choice)
        jsonschema.validate(json.loads(streamed), PERSON)
        anything = api.chat.completions.create(
            model="gemma-3-270m", messages=ask, max_tokens=200, temperature=0, response_format={"type": "json_object"}
        )
        if anything.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(anything.choices[0].message.content), dict)
        else:  # cut by max_tokens: a JSON object's start, as OpenAI leaves it
            assert anything.choices[0].message.content.lstrip().startswith("{")
