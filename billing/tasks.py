"""Celery interface to billing's periodic work."""

from __future__ import annotations

import logging

from celery import shared_task

from billing import selectors, services

log = logging.getLogger(__name__)


@shared_task(name="billing.tasks.reconcile_tick", ignore_result=True)
def reconcile_tick(max_releases: int = 500) -> int:
    """Release holds whose request ended, then replay the ledger and log any drift.

    Returns the number of problems still found (0 when the books are straight).
    """
    released = 0
    while released < max_releases and services.orphaned_hold_release_one():
        released += 1
    if released:
        log.warning("reconcile: released %d orphaned hold(s)", released)
    problems = selectors.reconcile_report()
    for problem in problems:
        log.error("reconcile drift: %s", problem)
    return len(problems)
