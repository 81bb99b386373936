"""Links in the clear, as every link was before issue 32: the baseline the benchmarks set
sealed links against (`bench/ring.py --seal-only`, `bench/moe.py --seal-only`). The handshake
still admits each peer; only the frames after it go unsealed. Never an agent's entry point.

    python -m bench.unsealed mahout.ring.stage ARGS     # an agent's module, its links in the clear
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Callable, Iterator

from mahout import link


@contextlib.contextmanager
def unsealed(clear: Callable[[link.Link], bool] = lambda _link: True) -> Iterator[None]:
    """Links admitted meanwhile in this process skip sealing where `clear(link)` says so."""
    secure = link.Link._secure

    def secure_unless_clear(self: link.Link, send_key: bytes, recv_key: bytes) -> None:
        if not clear(self):
            secure(self, send_key, recv_key)

    link.Link._secure = secure_unless_clear  # type: ignore[method-assign]
    try:
        yield
    finally:
        link.Link._secure = secure  # type: ignore[method-assign]


if __name__ == "__main__":
    module, sys.argv = sys.argv[1], sys.argv[1:]
    with unsealed():
        runpy.run_module(module, run_name="__main__", alter_sys=True)
