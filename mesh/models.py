"""The mesh app's models live in its two rooms; Django finds them here."""

from __future__ import annotations

from mesh.experts.models import ExpertModel, ExpertWorker
from mesh.rings.models import ModelLayout, RingPlan, RingStage

__all__ = ["ExpertModel", "ExpertWorker", "ModelLayout", "RingPlan", "RingStage"]
