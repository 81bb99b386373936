"""An outbound WebSocket that says "this host is alive" by merely being open.

If the mahout process is killed, its operating system closes the socket and
the gateway learns within a moment that the host's running jobs are dead, so
another host can continue them (the 20 s stall rule remains for a host that
freezes with its socket open). The connection is re-opened with bounded
backoff if it drops; it carries a ping every few seconds and nothing else.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

PING_INTERVAL_S = 5.0
RECONNECT_MIN_S = 1.0
RECONNECT_MAX_S = 30.0
OPEN_TIMEOUT_S = 10.0


def presence_url(server: str) -> str:
    """http(s)://host → ws(s)://host/hosts/ws."""
    base = server.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://") :] + "/hosts/ws"
    if base.startswith("http://"):
        return "ws://" + base[len("http://") :] + "/hosts/ws"
    raise ValueError(f"server URL must start with http:// or https://, got {server!r}")


class Presence:
    """Keeps the presence socket open in a daemon thread until :meth:`stop`."""

    def __init__(self, server: str, token: str, *, out: Callable[[str], None] = print) -> None:
        self.url = presence_url(server)
        self._headers = {"Authorization": f"Bearer {token}"}
        self._out = out
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mahout-presence", daemon=True)

    def start(self) -> Presence:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=OPEN_TIMEOUT_S + PING_INTERVAL_S)

    def _run(self) -> None:
        wait = RECONNECT_MIN_S
        while not self._stop.is_set():
            try:
                self._hold_open()
                wait = RECONNECT_MIN_S
            except Exception as exc:  # noqa: BLE001 - any failure means: reconnect later
                self.connected.clear()
                self._out(f"mahout: presence connection lost ({type(exc).__name__}); retrying in {wait:.0f} s")
            self._stop.wait(wait)
            wait = min(wait * 2, RECONNECT_MAX_S)

    def _hold_open(self) -> None:
        from websockets.sync.client import connect

        with connect(self.url, additional_headers=self._headers, open_timeout=OPEN_TIMEOUT_S) as socket:
            self.connected.set()
            while not self._stop.wait(PING_INTERVAL_S):
                socket.send('{"type": "ping"}')
                socket.recv(timeout=OPEN_TIMEOUT_S)
        self.connected.clear()


@contextlib.contextmanager
def presence(server: str, token: str, *, out: Callable[[str], None] = print) -> Iterator[Presence]:
    keeper = Presence(server, token, out=out).start()
    try:
        yield keeper
    finally:
        keeper.stop()
