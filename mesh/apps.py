from __future__ import annotations

from django.apps import AppConfig


class MeshConfig(AppConfig):
    name = "mesh"
    default_auto_field = "django.db.models.BigAutoField"
