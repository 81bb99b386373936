"""Reads for the customer API."""
from __future__ import annotations

from django.utils import timezone

from marketplace.models import ApiKey, CatalogModel, Request
from marketplace.secrets import secret_hash


def api_key_by_secret(*, secret: str) -> ApiKey | None:
    """The live key for a secret, or None (unknown or revoked)."""
    key = ApiKey.objects.select_related("user").filter(key_hash=secret_hash(secret)).first()
    if key is None or key.revoked_at is not None or not key.user.is_active:
        return None
    return key


def catalog_model_by_name(*, name: str) -> CatalogModel | None:
    return CatalogModel.objects.filter(name=name, active=True).first()


def catalog_models() -> list[CatalogModel]:
    return list(CatalogModel.objects.filter(active=True).order_by("name"))


def request_for_user(*, user, public_id: str) -> Request | None:  # type: ignore[no-untyped-def]
    return Request.objects.select_related("model").filter(user=user, public_id=public_id).first()


def request_state(*, public_id: str) -> Request:
    """The fields a listener needs to reconcile what it streamed with the truth."""
    return Request.objects.select_related("model").get(public_id=public_id)


def unix(ts) -> int:  # type: ignore[no-untyped-def]
    return int((ts or timezone.now()).timestamp())
