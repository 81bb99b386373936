"""How an operator names a host on the command line (ring_propose, moe_register)."""

from __future__ import annotations

from django.core.management.base import CommandError

from hosts.models import Host


def host_by_ref(ref: str) -> Host:
    """A host by id, or by name when the name is unique."""
    matches = list(Host.objects.filter(pk=int(ref)) if ref.isdigit() else Host.objects.filter(name=ref))
    if len(matches) != 1:
        raise CommandError(f"{'no' if not matches else 'more than one'} host {ref!r}; name it by id")
    return matches[0]
