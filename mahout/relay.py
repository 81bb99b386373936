"""Carrying a host's listening socket through the gateway's byte relay (`mesh.relay`), so a
host behind NAT is dialled like any other: every call is outbound from it.

Nothing above the socket changes: a `mahout.link` handshake and its sealing run end to end
through the relay, which only moves bytes (and sees only the handshake and ciphertext). The
ring's stages (`mahout.ring.relay`) and the expert workers (`mahout.moe.relay`) use it.

* `ListenerRelay` (the listener's side): holds one WebSocket open to the relay (reconnecting
  with bounded backoff); the gateway announces each connection dialled to it as
  ``{"open": n}``, its bytes as binary messages prefixed by ``>I`` n, its end as
  ``{"close": n}``. Each becomes a loopback connection to the host's own listening socket,
  pumped both ways.
* `Portal` (the dialler's side): a loopback port standing for the relayed listener; each
  connection to it is carried over a WebSocket of its own, its messages the raw bytes.
  `relay_portal` keeps one per URL for the life of the process (a ring's stages).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, Self

__all__ = ["ListenerRelay", "Portal", "relay_portal", "serve_reconnecting", "websocket_base"]

CONN = struct.Struct(">I")
CHUNK = 256 * 1024  # bytes read from a socket per relayed message (daphne refuses a message over 1 MiB)
OPEN_TIMEOUT_SECONDS = 10.0
RECONNECT_MIN_SECONDS, RECONNECT_MAX_SECONDS = 0.5, 10.0


def serve_reconnecting(
    serve: Callable[[], None],
    stop: threading.Event,
    *,
    ended: Callable[[], object],
    lost: Callable[[Exception, float], None],
) -> None:
    """Run `serve` (one connection's life) until `stop` is set: `ended()` after each, and
    after a failure `lost(error, seconds)` and a wait that doubles up to `RECONNECT_MAX_SECONDS`."""
    wait = RECONNECT_MIN_SECONDS
    while not stop.is_set():
        try:
            serve()
            wait = RECONNECT_MIN_SECONDS
        except Exception as exc:  # noqa: BLE001 - any failure means: reconnect later
            if not stop.is_set():
                lost(exc, wait)
        ended()
        stop.wait(wait)
        wait = min(wait * 2, RECONNECT_MAX_SECONDS)


def websocket_base(server: str) -> str:
    """The gateway's WebSocket origin for its HTTP(S) URL (``ws://`` or ``wss://``)."""
    return server.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)


def _open(url: str, token: str) -> Any:
    from websockets.sync.client import connect

    return connect(
        url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=OPEN_TIMEOUT_SECONDS, max_size=None
    )  # the link's own caps bound its frames


def _socket_to(send: Callable[[bytes], None], sock: socket.socket, prefix: bytes = b"") -> None:
    """Send what `sock` reads, `prefix`ed, until it ends (or the relay's side fails)."""
    from websockets.exceptions import ConnectionClosed

    try:
        while data := sock.recv(CHUNK):
            send(prefix + data)
    except (OSError, ConnectionClosed):
        pass


def _hang_up(sock: socket.socket) -> None:
    """End a relayed connection now: a plain close would wait for the thread still reading
    it, and its peer would not see the end (nor the link's refusal of an altered frame)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class ListenerRelay:
    """Carries the connections dialled through the relay at `url` to `local`, this host's own
    listening socket, until stopped. `what` names it in the lines it says."""

    def __init__(
        self, url: str, token: str, local: tuple[str, int], *, what: str = "relay", out: Callable[[str], None] = print
    ) -> None:
        self.url, self.token, self.what = url, token, what
        self.local = ("127.0.0.1" if local[0] in ("0.0.0.0", "") else local[0], local[1])
        self.out = out
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._socket: Any = None
        self._send_lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}

    def start(self) -> Self:
        threading.Thread(target=self._run, name=f"{self.what}-listener", daemon=True).start()
        return self

    def _run(self) -> None:
        serve_reconnecting(
            self._serve,
            self._stop,
            ended=self._ended,
            lost=lambda exc, wait: self.out(
                f"mahout: {self.what} connection lost ({type(exc).__name__}); retrying in {wait:.1f} s"
            ),
        )

    def _ended(self) -> None:
        """The relay socket closed: every connection it carried ends with it."""
        self.connected.clear()
        self._close_all()

    def _serve(self) -> None:
        with _open(self.url, self.token) as ws:
            self._socket = ws
            self.connected.set()
            for message in ws:
                if isinstance(message, bytes):
                    self._deliver(message)
                else:
                    self._control(json.loads(message))

    def _send(self, message: bytes | str) -> None:
        with self._send_lock:  # pumps of several connections share the socket
            self._socket.send(message)

    def _control(self, message: dict) -> None:
        if "open" in message:
            self._open_local(int(message["open"]))
        elif "close" in message:
            sock = self._conns.pop(int(message["close"]), None)
            if sock is not None:
                _hang_up(sock)

    def _open_local(self, conn: int) -> None:
        """A connection was dialled to this host: open one to its own listening socket."""
        try:
            sock = socket.create_connection(self.local, timeout=5.0)
        except OSError:
            self._send(json.dumps({"close": conn}))
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns[conn] = sock
        threading.Thread(target=self._pump_back, args=(conn, sock), name=f"{self.what}-{conn}", daemon=True).start()

    def _pump_back(self, conn: int, sock: socket.socket) -> None:
        _socket_to(self._send, sock, CONN.pack(conn))
        if self._conns.pop(conn, None) is not None:
            try:
                self._send(json.dumps({"close": conn}))
            except Exception:  # noqa: BLE001 - the relay socket is gone: every connection ends with it
                pass
        sock.close()

    def _deliver(self, message: bytes) -> None:
        (conn,) = CONN.unpack_from(message)
        sock = self._conns.get(conn)
        if sock is None:
            return
        try:
            sock.sendall(message[CONN.size :])
        except OSError:
            self._conns.pop(conn, None)
            _hang_up(sock)

    def _close_all(self) -> None:
        for sock in list(self._conns.values()):
            _hang_up(sock)
        self._conns.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._socket is not None:
            self._socket.close()
        self._close_all()


class Portal:
    """A loopback listener at `address`; each connection to it is pumped over a new dial
    WebSocket, until `close`."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.server.getsockname()[:2]
        threading.Thread(target=self._accept, name="relay-portal", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._carry, args=(sock,), name="relay-dial", daemon=True).start()

    def close(self) -> None:
        """No new connection (those under way end when either side closes them)."""
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self.server.close()

    def _carry(self, sock: socket.socket) -> None:
        try:
            ws = _open(self.url, self.token)
        except Exception:  # noqa: BLE001 - the dialler sees the connection close (a refused handshake)
            sock.close()
            return

        def outward() -> None:  # the dialler's bytes to the listener; its end closes the relayed connection
            _socket_to(ws.send, sock)
            ws.close()

        threading.Thread(target=outward, name="relay-out", daemon=True).start()
        try:
            for message in ws:
                if isinstance(message, bytes):
                    sock.sendall(message)
        except Exception:  # noqa: BLE001 - either end closing ends the connection
            pass
        finally:
            ws.close()
            _hang_up(sock)


_portals: dict[tuple[str, str], Portal] = {}
_portals_lock = threading.Lock()


def relay_portal(url: str, token: str) -> tuple[str, int]:
    """The loopback address standing for the listener reached by dialling `url` with `token`
    (one per URL, token and process, made on first use)."""
    with _portals_lock:
        portal = _portals.get((url, token))
        if portal is None:
            portal = _portals[(url, token)] = Portal(url, token)
    return portal.address
