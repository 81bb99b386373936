"""The base of every synchronous view a customer calls with an API key."""

from __future__ import annotations

from rest_framework.request import Request
from rest_framework.views import APIView

from accounts.models import ApiKey
from accounts.selectors import key_from_secret
from core.http import bearer_secret
from core.openapi import API_KEY


class KeyApi(APIView):
    security_scheme = API_KEY

    def key(self, request: Request) -> ApiKey:
        return key_from_secret(bearer_secret(request))
