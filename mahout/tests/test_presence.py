from __future__ import annotations

import threading
import time

import pytest

from mahout.presence import Presence, presence_url


class PresenceUrlTests:
    def test_it_maps_http_to_ws_and_https_to_wss(self) -> None:
        assert presence_url("http://127.0.0.1:8000/") == "ws://127.0.0.1:8000/hosts/ws"
        assert presence_url("https://gateway.example") == "wss://gateway.example/hosts/ws"

    def test_it_refuses_a_url_without_a_scheme(self) -> None:
        with pytest.raises(ValueError):
            presence_url("gateway.example")


class ReconnectTests:
    def test_a_lost_socket_that_comes_back_says_so(self, monkeypatch) -> None:
        """After "connection lost", the owner's last line must not stay an error once it is open again."""
        from websockets.sync.server import serve

        import mahout.presence

        monkeypatch.setattr(mahout.presence, "PRESENCE_RECONNECT_MIN_SECONDS", 0.05)
        opened = []

        def handler(socket) -> None:  # noqa: ANN001
            opened.append(socket)
            if len(opened) == 1:
                return  # the first connection is dropped at once (the gateway restarting)
            for _ in socket:  # the second stays open, answering nothing, until the client leaves
                pass

        lines: list[str] = []
        with serve(handler, "127.0.0.1", 0) as server:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            port = server.socket.getsockname()[1]
            keeper = Presence(f"http://127.0.0.1:{port}", "token", out=lines.append).start()
            try:
                deadline = time.monotonic() + 10
                while len(opened) < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert keeper.connected.wait(5)
                time.sleep(0.1)
            finally:
                keeper.stop()
                server.shutdown()
        assert [line.split(" (")[0] for line in lines] == [
            "mahout: presence connection lost",
            "mahout: presence connection back",
        ]
