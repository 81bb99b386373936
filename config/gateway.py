"""`python -m config.gateway …`: how the gateway runs daphne (every argument is daphne's).

Two things plain `daphne` does not do:

* **Bodies are bounded while they arrive.** Twisted receives a request's whole body (into a
  temporary file when it is large or chunked) before daphne calls the application, so the
  ASGI limit (`core.bodylimit`) would come after the disk was filled. Here the connection
  answers 413 in the API's error format and closes as soon as the received bytes pass
  `DATA_UPLOAD_MAX_MEMORY_SIZE`, whatever the request declared.
* **A request that is not valid HTTP** (a `Content-Length` that is not a number, headers past
  Twisted's size limit) gets a 400 in the API's error format, where Twisted writes a bare
  status line with no body (clients and fuzzers then read no error at all).
* **The access log leaves out the hosts' own traffic** (heartbeats, long-polls, token
  batches, their sockets), which would otherwise be most of the lines `make run` prints.
  `ACCESS_LOG_HOSTS=1` prints them again. The load balancer's health checks
  (`GET /healthz`, once a second per backend) are left out always.
"""

from __future__ import annotations

import json
import os
import sys

from daphne import cli
from daphne.access import AccessLogGenerator
from daphne.http_protocol import WebRequest

from config.health import HEALTH_PATH
from core.bodylimit import too_large

QUIET_PREFIXES = ("/hosts/api/", "/hosts/ws", "/api/rings/", "/api/moe/", "/api/expert-")


def quiet(request: str) -> bool:
    """Whether an access-log request ("POST /hosts/api/claim") is a host's routine call."""
    path = request.split(" ", 1)[-1]
    return path.startswith(QUIET_PREFIXES)


def health_check(request: str) -> bool:
    """Whether an access-log request is the load balancer's health check ("GET /healthz")."""
    return request.split(" ", 1)[-1] == HEALTH_PATH


class QuietAccessLog(AccessLogGenerator):
    """daphne's access log without the load balancer's health checks."""

    def write_entry(self, host, date, request, status=None, length=None, ident=None, user=None):  # noqa: ANN001, ANN201, PLR0913
        if health_check(request) or self.left_out(request):
            return
        super().write_entry(host, date, request, status=status, length=length, ident=ident, user=user)

    def left_out(self, request: str) -> bool:
        return False


class HostQuietAccessLog(QuietAccessLog):
    """… and without the hosts' routine calls."""

    def left_out(self, request: str) -> bool:
        return quiet(request)


class BoundedRequest(WebRequest):
    """daphne's request, refusing a body that grows past the limit while it arrives."""

    limit: int = 0
    received = 0
    refused = False

    def gotLength(self, length: int | None) -> None:  # noqa: N802 (Twisted's name)
        if length is not None and length > self.limit:  # declared over the limit: refused before a byte of it is read
            self._refuse()
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:  # noqa: N802 (Twisted's name)
        if self.refused:
            return
        self.received += len(data)
        if self.received > self.limit:
            self._refuse()
            return
        super().handleContentChunk(data)

    def process(self) -> None:
        if not self.refused:  # (a refused request never reaches the application)
            super().process()

    def _refuse(self) -> None:
        self.refused = True
        body = too_large(self.limit)
        self.channel.transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
        )
        self.channel.transport.loseConnection()


MALFORMED = json.dumps(
    {
        "error": {
            "message": "The request is not valid HTTP (a malformed header, or headers too large).",
            "type": "invalid_request_error",
            "param": None,
            "code": "malformed_request",
        }
    }
).encode()


def refuse_malformed(channel: object) -> None:
    """Twisted's answer to a request it cannot parse, in the API's error format, then close."""
    channel.transport.write(  # type: ignore[attr-defined]
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(MALFORMED)).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + MALFORMED
    )
    channel.loseConnection()  # type: ignore[attr-defined]


def main() -> None:
    import django
    from django.conf import settings

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    BoundedRequest.limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    from daphne import http_protocol

    http_protocol.WebRequest = BoundedRequest  # (daphne's factory gives each connection this name's requests)
    from twisted.web import http

    # (the one place Twisted refuses a request; patched on purpose)
    http.HTTPChannel._respondToBadRequestAndDisconnect = refuse_malformed  # type: ignore[method-assign]
    # daphne's CLI builds its access log from this name
    cli.AccessLogGenerator = QuietAccessLog if os.environ.get("ACCESS_LOG_HOSTS") == "1" else HostQuietAccessLog
    sys.argv[0] = "daphne"
    cli.CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
