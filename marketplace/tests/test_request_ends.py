"""A failed request's code finds its status and type beside it (`marketplace.lifecycle.errors`)."""

from __future__ import annotations

import pytest

from marketplace.lifecycle.errors import REQUEST_ENDS, request_ended


class RequestEndedTests:
    @pytest.mark.parametrize(
        ("code", "status", "kind"),
        [
            ("queue_timeout", 504, "server_error"),
            ("request_not_runnable", 400, "invalid_request_error"),
            ("host_failed", 502, "server_error"),
            ("cancelled", 502, "server_error"),
            ("invalid_structured_output", 502, "server_error"),
            ("logprobs_missing", 502, "server_error"),
            ("insufficient_credit", 502, "server_error"),  # a fallback's hold refused after admission
            ("key_limit_exceeded", 502, "server_error"),
            ("something_new", 502, "server_error"),
        ],
    )
    def test_it_answers_each_code_with_its_status_and_type(self, code: str, status: int, kind: str) -> None:
        error = request_ended(code, "Why.")
        assert (error.status, error.type, error.code, error.message) == (status, kind, code, "Why.")

    def test_only_a_queue_timeout_says_when_to_retry(self) -> None:
        assert request_ended("queue_timeout", "x").response()["Retry-After"] == "5"
        assert all(
            not request_ended(code, "x").response().has_header("Retry-After")
            for code in REQUEST_ENDS
            if code != "queue_timeout"
        )

    def test_a_request_failed_without_a_code_or_message_still_says_so(self) -> None:
        error = request_ended("", "")
        assert (error.status, error.code, error.message) == (502, "failed", "The request failed.")
