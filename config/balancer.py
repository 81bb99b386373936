"""The load balancer in front of several gateway processes: HAProxy (Debian's package).

HTTP mode, so SSE streams pass through unbuffered and WebSockets (a host's socket, a
customer's chat stream) are tunnelled; `leastconn` because streams are long-lived; a
backend that stops answering is taken out by the health check (`GET /healthz`, which needs
no key: `config.health`) within about two seconds, and a connection refused meanwhile is
retried on another backend (`redispatch`).
"""

from __future__ import annotations

TEMPLATE = """\
global
    maxconn 4000

defaults
    mode http
    option http-server-close
    option forwardfor
    option redispatch
    retries 3
    timeout connect 5s
    timeout client 1h
    timeout server 1h
    timeout tunnel 1h
    timeout http-keep-alive 30s

frontend elephant
    bind 127.0.0.1:{port}
    # a declared body over the gateway's limit is refused here, before a gateway buffers it
    http-request return status 413 content-type application/json string '{too_large}' \
if {{ req.hdr_val(content-length) gt {max_body} }}
    default_backend gateways

backend gateways
    balance leastconn
    option httpchk GET {health}
    http-check expect status 200
    default-server inter 1s fall 2 rise 1
{servers}
"""


def haproxy_config(*, port: int, backends: list[int], max_body: int | None = None) -> str:
    """HAProxy's configuration for gateways on 127.0.0.1:`backends`, listening on `port`;
    bodies declared over `max_body` (default: the gateway's MAX_BODY_BYTES) get a 413."""
    from django.conf import settings

    from config.health import HEALTH_PATH
    from core.bodylimit import too_large

    limit = max_body if max_body is not None else settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    servers = "\n".join(
        f"    server gateway{index} 127.0.0.1:{backend} check" for index, backend in enumerate(backends, 1)
    )
    return TEMPLATE.format(
        port=port, servers=servers, max_body=limit, too_large=too_large(limit).decode(), health=HEALTH_PATH
    )
