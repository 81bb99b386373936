"""Domain errors rendered the one way at every door: DRF views keep what `response()` adds
(Retry-After, a 429's rate-limit headers), and a socket's error frame has one shape."""

from __future__ import annotations

import json

from rest_framework import serializers
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from core.errors import DomainError


class Throttled(DomainError):
    status = 429
    code = "rate_limited"
    retry_after = 7


class NoCredit(DomainError):
    status = 402
    code = "insufficient_credit"


def answer(raised: Exception):  # noqa: ANN201 - a rendered DRF response
    class RaisingApi(APIView):
        def get(self, request: object) -> None:
            raise raised

    return RaisingApi.as_view()(APIRequestFactory().get("/"))


class ApiExceptionHandlerTests:
    def test_it_keeps_a_domain_errors_retry_after_and_headers(self) -> None:
        refusal = Throttled("Slow down.")
        refusal.headers = {"x-ratelimit-remaining-requests": "0"}
        response = answer(refusal)
        assert response.status_code == 429
        assert response["Retry-After"] == "7" and response["x-ratelimit-remaining-requests"] == "0"
        assert json.loads(response.content) == {
            "error": {"message": "Slow down.", "type": "rate_limit_error", "param": None, "code": "rate_limited"}
        }

    def test_it_renders_a_402_as_any_door_does(self) -> None:
        refusal = NoCredit("Top up.")
        response = answer(refusal)
        assert (response.status_code, json.loads(response.content)) == (402, refusal.body())
        assert not response.has_header("Retry-After")

    def test_it_names_the_first_bad_field_of_a_validation_error(self) -> None:
        response = answer(serializers.ValidationError({"wait": ["Too long."]}))
        assert response.status_code == 400
        assert json.loads(response.content)["error"] == {
            "message": "'wait': Too long.",
            "type": "invalid_request_error",
            "param": "wait",
            "code": "invalid_value",
        }


class FrameTests:
    def test_it_is_the_error_with_what_it_answers(self) -> None:
        frame = DomainError("Stop.", status=409, code="job_not_running").frame(job=3, seq=1)
        assert frame == {
            "type": "error",
            "job": 3,
            "seq": 1,
            "status": 409,
            "code": "job_not_running",
            "message": "Stop.",
        }
