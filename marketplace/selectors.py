"""Reads for the customer API."""
from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

from marketplace import routing
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


@dataclass(frozen=True)
class ServedModel:
    model: CatalogModel
    hosts_online: int
    hosts_warm: int


def served_models() -> list[ServedModel]:
    """The one catalog callers see: every active model at least one online host
    (or a ring's bridge, which is a host) serves, with how many hosts are warm.
    Read through a cache refreshed at the heartbeat cadence (`MODEL_LIST_CACHE_SECONDS`)."""
    cached = cache.get(SERVED_MODELS_CACHE_KEY)
    if cached is not None:
        return cached
    counts = routing.warm_host_counts()
    served = [
        ServedModel(model=model, hosts_online=counts[model.pk]["online"], hosts_warm=counts[model.pk]["warm"])
        for model in CatalogModel.objects.filter(pk__in=list(counts)).order_by("name")
    ]
    cache.set(SERVED_MODELS_CACHE_KEY, served, settings.MODEL_LIST_CACHE_SECONDS)
    return served


SERVED_MODELS_CACHE_KEY = "marketplace.served_models"


def request_for_user(*, user, public_id: str) -> Request | None:  # type: ignore[no-untyped-def]
    return Request.objects.select_related("model").filter(user=user, public_id=public_id).first()


def request_state(*, public_id: str) -> Request:
    """The fields a listener needs to reconcile what it streamed with the truth."""
    return Request.objects.select_related("model").get(public_id=public_id)


def unix(ts) -> int:  # type: ignore[no-untyped-def]
    return int((ts or timezone.now()).timestamp())
