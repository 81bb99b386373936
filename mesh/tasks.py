"""Celery interface to the mesh's periodic work."""

from __future__ import annotations

from celery import shared_task

from mesh.experts import services as experts


@shared_task(name="mesh.tasks.expert_market_tick", ignore_result=True)
def expert_market_tick() -> int:
    """Review every MoE model: mark silent coordinators, release and age out workers."""
    return experts.expert_market_tick()
