"""The measuring half of `bench/gpu_check.sh` (run by it, in its CUDA venv): the shipped model
through mahout's own benchmark on the CPU and with every layer on the GPU, then the engine
(one stage, greedy) on the CPU and on CUDA; one JSON object with the figures and ratios.

    .venv-with-cuda/bin/python bench/gpu_check.py [--threads N] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def llama_figures(threads: int) -> dict:
    from mahout.benchmark import run_benchmark
    from mahout.gpu import gpus_present, model_layers, offload_supported, plan_offload
    from mahout.model_files import assemble_shipped

    path = assemble_shipped(Path(tempfile.mkdtemp(prefix="gpu-check-")), progress=False)
    gpus, supported = gpus_present(), offload_supported()
    result: dict = {"gpu": gpus[0].name if gpus else None, "llama_offload_supported": supported}
    if not gpus or not supported:
        result["error"] = "llama-cpp-python cannot offload here: the CUDA build failed or no GPU was found"
        return result
    offload = plan_offload(
        "auto", gpu=gpus[0], supported=True, model_mb=path.stat().st_size / 2**20, n_layers=model_layers(path)
    )
    cpu = run_benchmark(path, threads, progress=False)
    gpu = run_benchmark(path, threads, progress=False, offload=offload)
    result.update(
        {
            "layers_offloaded": offload.layers,
            "cpu": cpu,
            "gpu_offload": gpu,
            "gen_tps_ratio": round(gpu["gen_tps"] / cpu["gen_tps"], 2),
            "prompt_tps_ratio": round(gpu["prompt_tps"] / cpu["prompt_tps"], 2),
        }
    )
    return result


def engine_figures(tokens: int, threads: int) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA GPU (a CPU-only torch build?)"}
    from engine.generate import build_stages, generate
    from engine.gguf_loader import default_model_path, read_config
    from engine.gguf_meta import open_gguf
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    model = default_model_path()
    config = read_config(open_gguf(model))
    prompt = Tokenizer(model).encode("The history of the elephant begins")
    runs = {}
    for device in ("cpu", "cuda"):
        stages = build_stages(model, [(0, config.n_layers)], n_rows=1, n_ctx=512, device=device)
        generate(stages, prompt, 4)  # warm-up (CUDA kernels, caches)
        stages = build_stages(model, [(0, config.n_layers)], n_rows=1, n_ctx=512, device=device)
        began = time.perf_counter()
        out = generate(stages, prompt, tokens)
        runs[device] = {
            "decode_tps": round(out.decode_tokens_per_s, 1),
            "wall_s": round(time.perf_counter() - began, 2),
            "tokens": out.token_ids,
        }
    same = runs["cpu"]["tokens"] == runs["cuda"]["tokens"]
    for run in runs.values():
        run["tokens"] = len(run["tokens"])
    return {
        **runs,
        "decode_tps_ratio": round(runs["cuda"]["decode_tps"] / runs["cpu"]["decode_tps"], 2),
        "same_greedy_tokens": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(
        json.dumps(
            {"llama_cpp": llama_figures(args.threads), "engine": engine_figures(args.tokens, args.threads)}, indent=2
        )
    )


if __name__ == "__main__":
    main()
