"""What the expert market's tests share: a host out of probation (whose workers the
coordinator checks at its usual share, not the probation one), and the environment a gateway
process needs to accept loopback workers."""

from __future__ import annotations

from django.utils import timezone

from hosts.models import Host
from testkit.personas import ServingHost, make_host

LOCAL_SWARM_ENV = {"MOE_ALLOW_PRIVATE_WORKERS": "1"}  # every worker of a test listens on loopback


def trusted_host(name: str, *, qualified: bool = True) -> ServingHost:
    """A host that left probation (as `marketplace.trust.reputation` would mark it)."""
    serving = make_host(name=name, qualified=qualified)
    Host.objects.filter(pk=serving.host.pk).update(trusted_at=timezone.now())
    serving.host = Host.objects.get(pk=serving.host.pk)
    return serving
