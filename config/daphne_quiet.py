"""`python -m config.daphne_quiet …`: daphne with its access log minus the hosts' own
traffic (heartbeats, long-polls, token batches, their sockets), which would otherwise be
most of the lines `make run` prints. `ACCESS_LOG_HOSTS=1` prints them again. Every other
argument is daphne's."""
from __future__ import annotations

import os
import sys

from daphne import cli
from daphne.access import AccessLogGenerator

QUIET_PREFIXES = ("/hosts/api/", "/hosts/ws", "/api/rings/", "/api/moe/", "/api/expert-")


def quiet(request: str) -> bool:
    """Whether an access-log request ("POST /hosts/api/claim") is a host's routine call."""
    path = request.split(" ", 1)[-1]
    return path.startswith(QUIET_PREFIXES)


class HostQuietAccessLog(AccessLogGenerator):
    def write_entry(self, host, date, request, status=None, length=None, ident=None, user=None):  # noqa: ANN001, ANN201, PLR0913
        if quiet(request):
            return
        super().write_entry(host, date, request, status=status, length=length, ident=ident, user=user)


def main() -> None:
    if os.environ.get("ACCESS_LOG_HOSTS") != "1":
        cli.AccessLogGenerator = HostQuietAccessLog  # daphne's CLI builds its access log from this name
    sys.argv[0] = "daphne"
    cli.CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
