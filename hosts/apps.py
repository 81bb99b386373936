from __future__ import annotations

from django.apps import AppConfig


class HostsConfig(AppConfig):
    name = "hosts"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from hosts import signals

        signals.connect()  # an owner deactivated: its hosts' sockets close
