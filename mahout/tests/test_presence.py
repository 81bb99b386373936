from __future__ import annotations

import pytest

from mahout.presence import presence_url


class PresenceUrlTests:
    def test_it_maps_http_to_ws_and_https_to_wss(self) -> None:
        assert presence_url("http://127.0.0.1:8000/") == "ws://127.0.0.1:8000/hosts/ws"
        assert presence_url("https://gateway.example") == "wss://gateway.example/hosts/ws"

    def test_it_refuses_a_url_without_a_scheme(self) -> None:
        with pytest.raises(ValueError):
            presence_url("gateway.example")
