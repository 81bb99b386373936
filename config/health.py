"""`GET /healthz`: whether this gateway process answers, for the load balancer in front.

Unauthenticated and cheap: no key, no session, no database (an async view: no thread hop).
It says that the process serves requests, not that PostgreSQL or Redis are up: with the
database down every backend would be taken out, and customers would get the balancer's bare
503 instead of the gateway's own error in the API's format. Its access-log lines are left
out (`config.gateway`): HAProxy asks every backend once a second.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe

HEALTH_PATH = "/healthz"


@require_safe
async def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})
