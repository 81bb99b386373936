"""The engine against llama.cpp per architecture, side by side in one run: decode tokens/s.

For each architecture the engine runs (gemma3, llama, qwen2, qwen3, and the mixtures of
experts qwen3moe and Mixtral, `engine.moe`) a random-weight model of that family
(`testkit.families`: its real vocabulary and a blueprint of the size asked for), and the
shipped Gemma 3 270M (Q4_K_M): greedy decode tokens/s of the engine (one stage,
one torch thread) and of llama-cpp-python (one thread) on the same file and prompt, rounds
alternating between the two so that machine noise hits both; medians and their ratio.

Sizes: `tiny` is the test models' blueprint (d_model 64, two layers: the output head over a
128-262k vocabulary is most of the work, and per-layer Python overhead the rest); `mid`
(default) is a Gemma-270M-sized blueprint (d_model 640, 18 layers, ffn 2048, 4 heads of 160,
1 KV head), so every architecture is compared at the shipped model's shape; the MoE models'
8 experts per layer are 512 wide there (2 routed per token: half the dense feed-forward's
work per token, four times its weights). The random models are float16; the shipped one is
Q4_K_M, which llama.cpp reads quantised.

`--device cuda` runs the engine's stage on a GPU (llama.cpp stays on one CPU thread): each
architecture's engine on CUDA, for `bench/gpu_check.sh` when a GPU is lent.

    .venv/bin/python bench/engine_families.py [--size mid|tiny] [--rounds 3] [--tokens 32] [--no-shipped] [--device cpu]
        [--only qwen3moe ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import torch  # noqa: E402
from ring import llama_decode_tps  # noqa: E402 - bench/ring.py, beside this script: decode tokens/s timed one way

from engine.device import add_device_argument  # noqa: E402
from engine.generate import build_stages, generate  # noqa: E402
from engine.gguf_loader import default_model_path, read_config  # noqa: E402
from engine.gguf_meta import gguf_field, open_gguf  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

FAMILIES = {
    "gemma3": "gemma",
    "llama": "llama3",
    "qwen2": "qwen2.5",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3moe",
    "mixtral": "mixtral",
}  # what is measured (the architecture, or Mixtral's llama with experts) -> family
SIZES = {
    "tiny": {},
    "mid": {"n_layer": 18, "n_embd": 640, "n_head": 4, "n_head_kv": 1, "n_ff": 2048},  # Gemma 3 270M's shape
}
MOE_SIZES = {"tiny": {}, "mid": {**SIZES["mid"], "n_ff_exp": 512}}
PROMPT = "Once upon a time, in a village at the edge of a great forest, there lived"


def engine_tps(path: Path, prompt_ids: list[int], tokens: int, device: torch.device) -> float:
    if has_experts(path):
        return moe_tps(path, prompt_ids, tokens)
    config = read_config(open_gguf(path))
    (stage,) = build_stages(path, [(0, config.n_layers)], n_rows=1, n_ctx=256, device=device)
    return generate([stage], prompt_ids, tokens).decode_tokens_per_s


def has_experts(path: Path) -> bool:
    reader = open_gguf(path)
    return bool(gguf_field(reader, f"{gguf_field(reader, 'general.architecture')}.expert_count"))


def moe_tps(path: Path, prompt_ids: list[int], tokens: int) -> float:
    """Greedy decode tokens/s of `engine.moe` with every expert local (on the CPU: the MoE
    engine's weights stay there), timed as `llama_decode_tps` times llama.cpp: first token
    to last."""
    from engine.moe import MoeModel
    from engine.moe_loader import load_moe

    config, weights = load_moe(path)
    model = MoeModel(config, weights, n_rows=1, n_ctx=256)
    stamps: list[float] = []
    original = model.forward

    def timed(*args: torch.Tensor) -> torch.Tensor:
        out = original(*args)
        stamps.append(time.perf_counter())
        return out

    model.forward = timed  # type: ignore[method-assign]
    model.generate(prompt_ids, tokens)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def measure(name: str, path: Path, rounds: int, tokens: int, device: torch.device) -> tuple[float, float]:
    """Median engine and llama.cpp decode tokens/s on one file, rounds alternating."""
    from scorer.llama import load_llama

    prompt_ids = Tokenizer(path).encode(PROMPT)
    llm = load_llama(path, n_ctx=256, threads=1)
    engine_tps(path, prompt_ids, 4, device)  # warm-up: the file's pages, torch's kernels
    llama_decode_tps(llm, prompt_ids, 4)
    engine, llama = [], []
    for i in range(rounds):
        for side in ("engine", "llama") if i % 2 == 0 else ("llama", "engine"):
            if side == "engine":
                engine.append(engine_tps(path, prompt_ids, tokens, device))
            else:
                llama.append(llama_decode_tps(llm, prompt_ids, tokens))
    llm.close()
    e, l_ = statistics.median(engine), statistics.median(llama)
    print(
        f"{name}: engine ({device}) {e:.2f} tok/s, llama-cpp-python {l_:.2f} tok/s -> ratio {e / l_:.2f} "
        f"(raw engine {[round(x, 2) for x in engine]}, llama {[round(x, 2) for x in llama]})",
        flush=True,
    )
    return e, l_


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="mid")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--no-shipped", action="store_true", help="skip the shipped Gemma 3 270M")
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), help="these architectures only")
    add_device_argument(parser, default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from testkit.families import MOE_FAMILIES, sdist_models, tiny_model

    folder = Path(tempfile.mkdtemp(prefix="engine-families-"))
    sdist = sdist_models(folder / "sdist")
    print(
        f"size {args.size} {SIZES[args.size] or '(the test blueprint)'}; {args.tokens} tokens; {args.rounds} rounds; "
        "1 thread each",
        flush=True,
    )
    ratios = {}
    for arch, family in FAMILIES.items():
        if args.only and arch not in args.only:
            continue
        size = (MOE_SIZES if family in MOE_FAMILIES else SIZES)[args.size]
        path = tiny_model(family, sdist, folder / f"{family}.gguf", **size)
        engine, llama = measure(f"{arch} ({family}, random float16)", path, args.rounds, args.tokens, args.device)
        ratios[arch] = engine / llama
        path.unlink()
    if not args.no_shipped:
        engine, llama = measure(
            "gemma3 (shipped Gemma 3 270M, Q4_K_M)", default_model_path(), args.rounds, args.tokens, args.device
        )
        ratios["shipped gemma3"] = engine / llama
    print(
        "engine ÷ llama.cpp decode tokens/s: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()) + " (floor 0.33)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
