"""Stripe's webhook endpoint. The signature is checked over the raw bytes of the
body (never a parsed and re-serialised copy): anything else is a 400."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from billing import services
from billing.errors import InvalidWebhook


@csrf_exempt
@require_POST
def stripe_webhook(request: HttpRequest) -> JsonResponse:
    """200 for every verified event (a replay included: Stripe must stop retrying);
    400 for a forged, stale or malformed delivery."""
    try:
        event = services.stripe_webhook_receive(
            payload=request.body, signature=request.headers.get("Stripe-Signature", "")
        )
    except InvalidWebhook as error:
        body = {"error": {"message": error.message, "type": "invalid_request_error", "param": None, "code": error.code}}
        return JsonResponse(body, status=400)
    return JsonResponse({"received": True, "event": event.event_id, "outcome": event.outcome})
