"""Billing's HTTP API: top-ups (API key) and payouts (host token). Each view parses,
calls one service, renders; refusals are DomainErrors rendered by core's mapping.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.apis import KeyApi
from billing import services
from billing.models import Payout, TopUp
from catalog.money import UCENTS_PER_CENT
from core.openapi import ERROR
from hosts.apis import HostApi

# --- top-ups ---------------------------------------------------------------------------


class TopupSerializer(serializers.Serializer):
    """A top-up as `topup_body` renders it."""

    id = serializers.IntegerField()
    object = serializers.CharField(help_text="topup")
    amount_cents = serializers.IntegerField()
    amount_ucents = serializers.IntegerField()
    currency = serializers.CharField()
    status = serializers.CharField(help_text="creating, open, paid or failed")
    checkout_url = serializers.CharField(allow_blank=True, help_text="where to send the customer to pay")


def topup_body(topup: TopUp) -> dict:
    return {
        "id": topup.pk,
        "object": "topup",
        "amount_cents": topup.amount_cents,
        "amount_ucents": topup.amount_ucents,
        "currency": topup.currency,
        "status": topup.status,
        "checkout_url": topup.checkout_url,
    }


class TopupCreateApi(KeyApi):
    """POST {"amount_usd": "20.00"} → 201 with the Stripe Checkout URL to send the customer to.
    Credit arrives only when Stripe's webhook confirms the payment."""

    class InputSerializer(serializers.Serializer):
        amount_usd = serializers.DecimalField(max_digits=9, decimal_places=2, min_value=0)

    # 502: Stripe refused or could not be reached; 503: top-ups are not configured here
    @extend_schema(responses={201: TopupSerializer, 502: ERROR, 503: ERROR})
    def post(self, request: Request) -> Response:
        key = self.key(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        amount_cents = int(serializer.validated_data["amount_usd"] * 100)
        back = request.build_absolute_uri("/")  # the dashboard, as the caller reached this gateway
        topup = services.topup_create(
            user=key.user,
            amount_cents=amount_cents,
            success_url=f"{back}?topup=success",
            cancel_url=f"{back}?topup=cancelled",
        )
        return Response(topup_body(topup), status=201)


# --- hosts: payouts ------------------------------------------------------------


class PayoutSerializer(serializers.Serializer):
    """A payout as `payout_body` renders it."""

    id = serializers.IntegerField()
    object = serializers.CharField(help_text="payout")
    amount_ucents = serializers.IntegerField()
    status = serializers.CharField(help_text="requested, sending, paid or failed")
    failure_reason = serializers.CharField(allow_null=True)
    created_at = serializers.DateTimeField()
    decided_at = serializers.DateTimeField(allow_null=True)


def payout_body(payout: Payout) -> dict:
    return {
        "id": payout.pk,
        "object": "payout",
        "amount_ucents": payout.amount_ucents,
        "status": payout.status,
        "failure_reason": payout.failure_reason or None,
        "created_at": payout.created_at,
        "decided_at": payout.decided_at,
    }


class HostPayoutCreateApi(HostApi):
    """POST {} (everything available) or {"amount_ucents": N} → 201 with a requested payout."""

    class InputSerializer(serializers.Serializer):
        amount_ucents = serializers.IntegerField(min_value=UCENTS_PER_CENT, required=False)

    @extend_schema(responses={201: PayoutSerializer, 409: ERROR})
    def post(self, request: Request) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        payout = services.payout_request(host=host, amount_ucents=serializer.validated_data.get("amount_ucents"))
        return Response(payout_body(payout), status=201)
