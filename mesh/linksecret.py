"""The secrets the gateway issues for peer links (`mahout.link`'s handshake): one per ring
plan, handed to its stage hosts and its bridge, and one per expert worker, handed to the
volunteer serving it and to its model's coordinator. Stored as they are (the gateway must
hand them out again), shown in no admin form, never in a log."""

from __future__ import annotations

from core.secrets import secret_new

__all__ = ["link_secret_new"]


def link_secret_new() -> str:
    """A fresh link secret (a model field default: migrations refer to it by name)."""
    return secret_new("link")
