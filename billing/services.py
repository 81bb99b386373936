"""Billing's write API, as the other apps, views, tasks and tests call it.

Writes to the ledger. Every function runs in (or opens) one transaction and takes row
locks in a fixed order — customer account, then API key — so concurrent admissions and
settlements serialise instead of overspending. The code lives in one module per
responsibility; this one only names what callers may use, so the modules can move
without touching them:

    ledger           accounts, `ledger_post` (the one way a transaction is appended), grants
    holds            a request's worst-case cost reserved: the credit and key-cap limits
    settlement       the host-share rule and the exactly-once charge of a hold
    audits           the audit escrow: released to the host or refunded to the customer
    topups           Stripe Checkout top-ups, and the refunds and chargebacks that take them back
    stripe_events    Stripe's webhook: verified, recorded once, applied
    payouts          host payouts, requested → sending → paid | failed; forfeits
    payout_accounts  a machine's Stripe Connect account, onboarding → ready
"""

from __future__ import annotations

from billing.audits import audit_refund, audit_release, audit_score_pay
from billing.holds import hold_place, hold_release, hold_steps, orphaned_hold_release_one
from billing.ledger import (
    account_for_customer,
    account_for_host,
    credit_grant,
    credit_grant_by_operator,
    system_account,
)
from billing.payout_accounts import payout_account_onboard, payout_account_refresh
from billing.payouts import earnings_forfeit, payout_approve, payout_post, payout_request, payout_void
from billing.settlement import Settlement, hold_settle, split_by_layers, split_cost
from billing.stripe_events import CREDITING_EVENTS, stripe_event_apply, stripe_webhook_receive
from billing.topups import topup_create, topup_rule

__all__ = [
    "CREDITING_EVENTS",
    "Settlement",
    "account_for_customer",
    "account_for_host",
    "audit_refund",
    "audit_release",
    "audit_score_pay",
    "credit_grant",
    "credit_grant_by_operator",
    "earnings_forfeit",
    "hold_place",
    "hold_release",
    "hold_settle",
    "hold_steps",
    "orphaned_hold_release_one",
    "payout_account_onboard",
    "payout_account_refresh",
    "payout_approve",
    "payout_post",
    "payout_request",
    "payout_void",
    "split_by_layers",
    "split_cost",
    "stripe_event_apply",
    "stripe_webhook_receive",
    "system_account",
    "topup_create",
    "topup_rule",
]
