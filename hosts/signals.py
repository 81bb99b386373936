"""An owner's account deactivated (the admin's "active" box, or any save that clears it):
every socket of its hosts is closed at once (4403), as a ban closes one host's. The doors
already refuse the hosts of an inactive owner (`hosts.selectors.host_refusal`); this makes
the sockets that were open when it happened go too, instead of staying until they reconnect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from django.db.models.signals import post_save, pre_save

from hosts.models import Host
from hosts.services import owner_sockets_close

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def _remember_active(sender: type[User], instance: Any, **kwargs: Any) -> None:
    if instance.pk is None:
        instance._was_active = False
        return
    instance._was_active = sender.objects.filter(pk=instance.pk, is_active=True).exists()


def _close_when_deactivated(sender: type, instance: Any, created: bool, **kwargs: Any) -> None:
    if not created and getattr(instance, "_was_active", False) and not instance.is_active:
        owner_sockets_close(hosts=Host.objects.filter(owner_id=instance.pk))


def connect() -> None:
    user = get_user_model()
    pre_save.connect(_remember_active, sender=user, dispatch_uid="hosts.owner_active_before")
    post_save.connect(_close_when_deactivated, sender=user, dispatch_uid="hosts.owner_deactivated")
