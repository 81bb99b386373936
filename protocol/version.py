"""The host client's version, in a room both sides read: mahout reports it in every heartbeat,
the gateway names the wheel it serves by it and compares hosts' reports with it."""

from __future__ import annotations

MAHOUT_VERSION = "0.7.0"
