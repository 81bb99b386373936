"""Ring stages behind NAT, reached through the gateway's ring relay (`mesh.rings.consumers`).

Every call is outbound from the host, so two stages each behind its own home router form a
ring. Nothing above the socket changes: the link's handshake and sealing (`mahout.link`) run
end to end through the relay, which only moves bytes.

* `StageRelay` (the stage's side): holds ``…/api/rings/<ring>/relay/stage/<index>`` open
  (reconnecting with bounded backoff); each connection the gateway announces becomes a
  loopback connection to the stage's own listening socket, pumped both ways.
* `relay_portal` (the dialler's side, a stage's upstream or the bridge): a loopback port
  standing for a relayed stage; each connection to it is carried over its own
  ``…/relay/dial/<index>`` WebSocket. `mahout.ring.rendezvous.dial_stage` dials it when the
  stage reported `protocol.ring.RELAY_ADDRESS`.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from mahout.moe.relay import serve_reconnecting, websocket_base
from protocol.ring import RELAY_ADDRESS

__all__ = ["RELAY_ADDRESS", "StageRelay", "relay_portal"]

CONN = struct.Struct(">I")
CHUNK = 64 * 1024  # bytes read from a socket per relayed message
OPEN_TIMEOUT_S = 10.0


def stage_relay_url(server: str, ring_id: int, role: str, index: int) -> str:
    return f"{websocket_base(server)}/api/rings/{ring_id}/relay/{role}/{index}"


def _open(url: str, token: str) -> Any:
    from websockets.sync.client import connect

    return connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=OPEN_TIMEOUT_S,
                   max_size=None)


def _socket_to(send: Callable[[bytes], None], sock: socket.socket, prefix: bytes = b"") -> None:
    """Send what `sock` reads, `prefix`ed, until it ends (or the relay's side fails)."""
    try:
        while data := sock.recv(CHUNK):
            send(prefix + data)
    except OSError:
        pass


class StageRelay:
    """Carries the connections dialled to stage `index` through the relay to `local`, the
    stage's own listening socket, until stopped."""

    def __init__(self, server: str, token: str, ring_id: int, index: int, local: tuple[str, int], *,
                 out: Callable[[str], None] = print) -> None:
        self.url, self.token = stage_relay_url(server, ring_id, "stage", index), token
        self.local = ("127.0.0.1" if local[0] in ("0.0.0.0", "") else local[0], local[1])
        self.out = out
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._socket: Any = None
        self._send_lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}

    def start(self) -> StageRelay:
        threading.Thread(target=self._run, name="ring-relay-stage", daemon=True).start()
        return self

    def _run(self) -> None:
        serve_reconnecting(self._serve, self._stop, ended=self._ended, lost=lambda exc, wait: self.out(
            f"mahout: ring relay connection lost ({type(exc).__name__}); retrying in {wait:.1f} s"))

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
                sock.close()

    def _open_local(self, conn: int) -> None:
        """A connection was dialled to this stage: open one to the stage's own socket."""
        try:
            sock = socket.create_connection(self.local, timeout=5.0)
        except OSError:
            self._send(json.dumps({"close": conn}))
            return
        sock.settimeout(None)
        self._conns[conn] = sock
        threading.Thread(target=self._pump_back, args=(conn, sock), name=f"ring-relay-{conn}", daemon=True).start()

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
            sock.sendall(message[CONN.size:])
        except OSError:
            self._conns.pop(conn, None)
            sock.close()

    def _close_all(self) -> None:
        for sock in list(self._conns.values()):
            sock.close()
        self._conns.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._socket is not None:
            self._socket.close()
        self._close_all()


class _Portal:
    """A loopback listener; each connection to it is pumped over a new dial WebSocket."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.server.getsockname()[:2]
        threading.Thread(target=self._accept, name="ring-relay-portal", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(sock,), name="ring-relay-dial", daemon=True).start()

    def _carry(self, sock: socket.socket) -> None:
        try:
            ws = _open(self.url, self.token)
        except Exception:  # noqa: BLE001 - the dialler sees the connection close and dials again
            sock.close()
            return
        def outward() -> None:  # the dialler's bytes to the stage; its end closes the relayed connection
            _socket_to(ws.send, sock)
            ws.close()

        threading.Thread(target=outward, name="ring-relay-out", daemon=True).start()
        try:
            for message in ws:
                if isinstance(message, bytes):
                    sock.sendall(message)
        except Exception:  # noqa: BLE001 - either end closing ends the connection
            pass
        finally:
            ws.close()
            sock.close()


_portals: dict[tuple[str, str], _Portal] = {}
_portals_lock = threading.Lock()


def relay_portal(server: str, token: str, ring_id: int, index: int) -> tuple[str, int]:
    """The loopback address standing for stage `index` of the ring, reached through the relay
    (one per stage and process, made on first use)."""
    url = stage_relay_url(server, ring_id, "dial", index)
    with _portals_lock:
        portal = _portals.get((url, token))
        if portal is None:
            portal = _portals[(url, token)] = _Portal(url, token)
    return portal.address
