"""The ring's wire format is `mahout.link`'s framed TCP links; this module keeps the names
that tools and tests import from here."""
from __future__ import annotations

from mahout.link import MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES, Link, LinkClosed, connect, listen

__all__ = ["MAX_HEADER_BYTES", "MAX_PAYLOAD_BYTES", "Link", "LinkClosed", "connect", "listen"]
