"""Billing refusals. Each maps to an HTTP 402 with its `code`."""
from __future__ import annotations


class BillingError(Exception):
    code = "billing_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InsufficientCredit(BillingError):
    code = "insufficient_credit"


class KeyLimitExceeded(BillingError):
    code = "key_limit_exceeded"
