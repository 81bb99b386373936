"""The Celery app. Tasks are thin interfaces over services (see */tasks.py)."""

from __future__ import annotations

import os

from celery import Celery

from core import broker

broker.register()
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("elephant")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _schedule_watchdogs(sender: Celery, **_: object) -> None:
    from django.conf import settings

    sender.add_periodic_task(
        settings.WATCHDOG_INTERVAL_SECONDS, sender.signature("marketplace.tasks.watchdog_tick"), name="watchdog"
    )
    sender.add_periodic_task(
        settings.WATCHDOG_INTERVAL_SECONDS, sender.signature("marketplace.tasks.canary_scoring"), name="canary scoring"
    )
    sender.add_periodic_task(
        settings.WATCHDOG_INTERVAL_SECONDS, sender.signature("marketplace.tasks.audit_scoring"), name="audit scoring"
    )
    sender.add_periodic_task(
        settings.WATCHDOG_INTERVAL_SECONDS, sender.signature("mesh.tasks.expert_market_tick"), name="expert market"
    )
    sender.add_periodic_task(
        settings.RECONCILE_INTERVAL_SECONDS, sender.signature("billing.tasks.reconcile_tick"), name="reconcile"
    )
