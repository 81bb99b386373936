"""Layer counts of the catalog's models (their GGUF's ``block_count``), seeded by a migration."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from mesh.rings.models import ModelLayout

LAYOUTS = {"gemma-3-270m": 18}


def layout_seed(catalog_model: type[CatalogModel], model_layout: type[ModelLayout]) -> None:
    """Record the layer count of every known catalog model (idempotent; models passed in so
    that migrations can use their historical versions)."""
    for name, n_layers in LAYOUTS.items():
        model = catalog_model.objects.filter(name=name).first()
        if model is not None:
            model_layout.objects.update_or_create(model=model, defaults={"n_layers": n_layers})
