from __future__ import annotations

from django.apps import AppConfig


class MarketplaceConfig(AppConfig):
    name = "marketplace"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings

        if settings.CANARY_PROMPTS_FILE:  # a broken file stops the process now, with one line saying why
            from marketplace.lifecycle.canaries import corpus

            corpus()
