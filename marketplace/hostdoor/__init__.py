"""The host's door: the job API under /hosts/api/ and the host's WebSocket.

    host_apis    the views (`host_urls`)
    consumers    the host's WebSocket: presence, claims, token batches
    claiming     a host's claim: the long-poll and what it is offered
    claim_slots  how many jobs a host may hold at once
    pushing      a host's token batches, applied

The door calls `marketplace.services` and the trust rooms; no room below imports it.
"""
