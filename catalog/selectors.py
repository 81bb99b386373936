"""Reads of the catalog."""
from __future__ import annotations

from catalog.models import CatalogModel


def catalog_model_by_name(*, name: str) -> CatalogModel | None:
    """The active catalog entry of that name, or None."""
    return CatalogModel.objects.filter(name=name, active=True).first()


def catalog_models() -> list[CatalogModel]:
    return list(CatalogModel.objects.filter(active=True).order_by("name"))
