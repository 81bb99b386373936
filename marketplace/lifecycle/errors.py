"""The lifecycle's refusals to hosts: what a host sent or asked cannot be applied.

Each is a `core.errors.DomainError`, so its HTTP status and code live on the class and
every door (HTTP, WebSocket) renders it the one way `core.errors` does.
"""
from __future__ import annotations

from core.errors import DomainError


class BadResult(DomainError):
    """What the host sent back cannot be the answer (wrong shape): nothing is settled."""

    code = "invalid_result"


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
