"""The mesh app's admin lives in its two rooms; Django's autodiscovery finds it here."""

from __future__ import annotations

from mesh.experts import admin as experts_admin  # noqa: F401  registers the expert market's models
from mesh.rings import admin as rings_admin  # noqa: F401  registers the rings' models
