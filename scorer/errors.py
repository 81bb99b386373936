"""What a host refuses to run: the request's fault, not the machine's."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The job's own content cannot be run (a parameter out of range, a prompt past the
    context): the customer's request is at fault, not this machine. mahout reports it as
    such, so it is no strike against the host."""
