"""What is deleted is gone (issue 30): SQLite overwrites deleted rows, and a customer's text
waits in the channel layer for seconds, not a minute."""

from __future__ import annotations

from pathlib import Path

import pytest
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection


@pytest.mark.django_db(transaction=True)
def test_sqlite_overwrites_what_it_deletes() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL keeps deleted rows until VACUUM: README's privacy section says so")
    marker = "a-customer-secret-" + "x" * 64
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA secure_delete")
        assert cursor.fetchone()[0] == 1
        cursor.execute("CREATE TABLE privacy_probe (text TEXT)")
        cursor.execute("INSERT INTO privacy_probe VALUES (%s)", [marker])
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert marker.encode() in Path(connection.settings_dict["NAME"]).read_bytes(), "(the probe reached the file)"
        cursor.execute("DELETE FROM privacy_probe")
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        cursor.execute("DROP TABLE privacy_probe")
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    database = Path(connection.settings_dict["NAME"])
    assert marker.encode() not in database.read_bytes()
    wal = database.with_name(database.name + "-wal")
    assert not wal.exists() or marker.encode() not in wal.read_bytes()


def test_token_messages_expire_within_seconds() -> None:
    layer = get_channel_layer()
    assert settings.CHANNEL_EXPIRY_SECONDS <= 10
    config = settings.CHANNEL_LAYERS["default"].get("CONFIG", {})
    if "pubsub" in settings.CHANNEL_LAYERS["default"]["BACKEND"]:
        return  # (Redis pub/sub keeps nothing: a message no one listens for is dropped at once)
    assert config["expiry"] == settings.CHANNEL_EXPIRY_SECONDS == layer.expiry
