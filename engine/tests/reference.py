"""llama-cpp-python as the reference implementation for the golden tests.

The wheel in the venv is built for the build machine's CPU, AMX included; where the kernel
does not grant AMX tile state (this VM), llama.cpp's AMX weight buffers die with SIGILL on
the first matmul. Turning off the extra (repacked/AMX) buffer types keeps llama.cpp on its
plain CPU kernels, which is all a reference needs.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
from llama_cpp import Llama
from llama_cpp import llama as llama_module


def reference_llama(model_path: str | Path, *, n_ctx: int = 256, n_threads: int = 1, logits_all: bool = True) -> Llama:
    default_params = llama_module.llama_cpp.llama_model_default_params

    def plain_buffer_params() -> llama_module.llama_cpp.llama_model_params:
        params = default_params()
        params.use_extra_bufts = False
        return params

    with mock.patch.object(llama_module.llama_cpp, "llama_model_default_params", plain_buffer_params):
        return Llama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            logits_all=logits_all,
            verbose=False,
        )


def greedy_reference(llm: Llama, prompt_ids: list[int], n_tokens: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation and its logits after the prompt, both from raw logits."""
    llm.reset()
    llm.eval(prompt_ids)
    first_logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)  # (V,)
    logits, out = first_logits, []
    while True:
        out.append(int(logits.argmax()))
        if len(out) == n_tokens:
            return out, first_logits
        llm.eval([out[-1]])
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)  # (V,)
