"""The mesh API under /api/: rings (layer pipelines) and the expert market (MoE)."""

from __future__ import annotations

from django.urls import include, path

urlpatterns = [
    path("", include("mesh.rings.urls")),
    path("", include("mesh.experts.urls")),
]
