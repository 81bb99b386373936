from __future__ import annotations

from django.urls import path

from billing import apis, webhooks

urlpatterns = [
    path("stripe/webhook/", webhooks.stripe_webhook),
    path("api/topups", apis.TopupCreateApi.as_view()),
    path("api/host/payouts", apis.HostPayoutCreateApi.as_view()),
]
