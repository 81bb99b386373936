"""Run an agent's module with its links in the clear, as every link was before issue 32: the
baseline the benchmarks set sealed links against (`bench/ring.py --seal-only`,
`bench/moe.py --seal-only`). The handshake still admits each peer; only the frames after it
go unsealed. Never an agent's entry point.

    python -m bench.unsealed mahout.ring.stage ARGS     # or mahout.moe.worker ARGS
"""
from __future__ import annotations

import runpy
import sys

from mahout import link


def unseal() -> None:
    """Links admitted from now on in this process skip sealing."""
    link.Link._secure = lambda self, send_key, recv_key: None  # type: ignore[method-assign]


if __name__ == "__main__":
    unseal()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
