"""The lifecycle's errors: its refusals to hosts (what a host sent or asked cannot be
applied), and the ends of a request that failed, as its customer is told them.

Each is a `core.errors.DomainError`, so its HTTP status and code live on the class and
every door (HTTP, WebSocket) renders it the one way `core.errors` does. A failed request
keeps only its code (`Request.error_code`, written by `request_fail`); `request_ended`
finds the status and type beside it here.
"""

from __future__ import annotations

from billing.errors import InsufficientCredit, KeyLimitExceeded, RateLimited, TooManyStreams
from core.errors import DomainError


class BadResult(DomainError):
    """What the host sent back cannot be the answer (wrong shape): nothing is settled."""

    code = "invalid_result"


class CompletionRefused(BadResult):
    """The completion is no evidence of its answer (`marketplace.lifecycle.evidence`): the
    attempt ends as the host's failure, nothing paid; `proven`: no honest draw could be it."""

    status = 422
    code = "completion_refused"

    def __init__(self, message: str, *, proven: bool = False) -> None:
        super().__init__(message)
        self.proven = proven


class HostRefused(DomainError):
    """The host may not do this (paused, not qualified, not its job)."""

    status = 403
    code = "forbidden"


class JobNotRunning(DomainError):
    """The job already ended (or was never claimed): the host must stop."""

    status = 409
    code = "job_not_running"


class SequenceGap(DomainError):
    status = 409
    code = "sequence_gap"


class TextBoundExceeded(JobNotRunning):
    """The host sent more than the job's max_tokens allows: its attempt was ended."""

    code = "text_bound_exceeded"


class RequestEnded(DomainError):
    """A request ended without a whole answer. An end whose code is not named below (or a
    request failed without one: `failed`) is the gateway's or its hosts' failure, a 502."""

    status = 502
    code = "failed"
    type = "server_error"


class QueueTimeout(RequestEnded):
    """No host claimed the request in time."""

    status = 504
    code = "queue_timeout"
    retry_after = 5  # no host was free: hosts come and go within the heartbeat's seconds


class RequestNotRunnable(RequestEnded):
    """Two hosts could not run the request's own content: the customer's to change."""

    status = 400
    code = "request_not_runnable"
    type = "invalid_request_error"


class HostFailed(RequestEnded):
    """The host serving it failed and no other took over (or a canary went unanswered)."""

    code = "host_failed"


class Cancelled(RequestEnded):
    """The customer went away before any text."""

    code = "cancelled"


class InvalidStructuredOutput(RequestEnded):
    """The host's answer broke the request's `response_format`."""

    code = "invalid_structured_output"


class LogprobsMissing(RequestEnded):
    """The host sent text without the log-probabilities asked for."""

    code = "logprobs_missing"


class AnswerTooLong(RequestEnded):
    """The finished answer counted far more tokens than max_tokens. Gateways before this
    one failed such requests unbilled; they now settle cut at the limit (`settlement`). Kept
    so that the requests that failed so still answer with their error."""

    code = "answer_too_long"


class FallbackRefused(RequestEnded):
    """A fallback model's larger hold was refused: the request ends with the billing
    refusal's own code, as a 502 (it was admitted; the refusal came later)."""


REQUEST_ENDS: dict[str, type[RequestEnded]] = {
    **{
        end.code: end
        for end in (
            QueueTimeout,
            RequestNotRunnable,
            HostFailed,
            Cancelled,
            InvalidStructuredOutput,
            LogprobsMissing,
            AnswerTooLong,
        )
    },
    **{
        refusal.code: FallbackRefused for refusal in (InsufficientCredit, KeyLimitExceeded, RateLimited, TooManyStreams)
    },
}


def request_ended(code: str, message: str) -> RequestEnded:
    """The error a request that failed with `code` (its `error_code`) answers its customer."""
    return REQUEST_ENDS.get(code, RequestEnded)(message or "The request failed.", code=code or "failed")
