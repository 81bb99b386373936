"""Bearer secrets (API keys, host tokens): shown once, stored as a hash and a prefix."""

from __future__ import annotations

import hashlib
import secrets

PREFIX_CHARS = 12


def secret_new(kind: str) -> str:
    return f"{kind}-{secrets.token_urlsafe(30)}"


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_prefix(secret: str) -> str:
    return secret[:PREFIX_CHARS]
