"""What a ring's hosts and the gateway agree on beyond the link frames (`mahout.link`).

A stage behind NAT cannot be dialled. It reports `RELAY_ADDRESS` instead of ``HOST:PORT``
and holds a WebSocket open to the gateway's ring relay (`mesh.rings.consumers`), which
carries every connection its upstream neighbour or the bridge dials to it
(`mahout.ring.relay`). The link's handshake and sealing run end to end through it: the
relay only moves bytes.
"""

from __future__ import annotations

RELAY_ADDRESS = "relay"
