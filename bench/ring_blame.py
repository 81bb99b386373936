"""Finding the stage behind a ring's failed audit (issue 29), measured in one run.

A three-stage ring of the shipped model (stage threads in this process, each behind its own
loopback link, the output head shared) serves `--requests` chats one at a time at
temperatures 0, 0.7 and 1.2, with the stages on 1 torch thread. For each request every
stage's evidence is exported and `mahout.ring.blame` recomputes every stage on its own
inputs on `--check-threads` threads (another thread count than the ring's, as a checker's
machine would be), and the same for a ring whose middle stage runs an imitation of its
layers (two layers' feed-forward output matrices swapped), and rings whose middle stage's
every matrix carries Gaussian noise of `--noise` times its own standard deviation (a cheaper,
coarser copy of the weights: Q4_K's own rounding is of the order of 0.05). Printed:

* per stage, the largest recomputation error over the honest requests, against the
  tolerance (`mahout.ring.blame.TOLERANCE`): the margin against a false blame;
* the smallest error of the imitating stage, and whom each check blamed;
* the check's cost against the generation's: wall seconds to recompute every stage ÷
  wall seconds the ring took to generate the same request (same machine, same run);
* per noise level, the imitating stage's smallest error and how often it alone was blamed;
* evidence bytes per token a stage keeps (what its memory budget buys).

    .venv/bin/python bench/ring_blame.py [--requests 30] [--max-tokens 48] [--check-threads 2] [--noise 0.003,0.01,0.03]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.generate import build_stages  # noqa: E402
from engine.gguf_loader import default_model_path  # noqa: E402
from mahout.ring.blame import TOLERANCE, StageSlice, blame, stage_recompute  # noqa: E402
from mahout.ring.evidence import record_bytes  # noqa: E402
from mahout.ring.local import ThreadRing, split_layers  # noqa: E402
from mahout.ring.membership import Limits  # noqa: E402
from scorer.llama import PromptTokenizer  # noqa: E402

PROMPTS = [
    "Write a haiku about elephants.",
    "Explain what a pipeline of GPUs is.",
    "List three rivers in Africa.",
    "Tell me a short story about a lighthouse keeper.",
    "What is the capital of Peru and why is it there?",
]
TEMPERATURES = [0.0, 0.7, 1.2]


def serve(ring: ThreadRing, tokenizer: PromptTokenizer, i: int, max_tokens: int) -> tuple[str, list[int], int, float]:
    from testkit.formats import rendered

    temperature = TEMPERATURES[i % len(TEMPERATURES)]
    payload = rendered(
        {
            "id": f"b{i}",
            "model": "gemma-3-270m",
            "kind": "chat",
            "prompt": None,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "params": {"max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "stop": None, "seed": i},
        }
    )
    prompt = tokenizer.tokens(payload)
    request_id = f"job-{i}-bench"
    torch.set_num_threads(1)
    started = time.perf_counter()
    drawn = ring.bridge.submit(prompt, max_tokens, temperature=temperature, seed=i, request_id=request_id).result()
    return request_id, [*prompt, *drawn], len(prompt), time.perf_counter() - started


def check(ring: ThreadRing, request_id: str, sequence: list[int], prompt_len: int, recompute, threads: int):  # noqa: ANN001, ANN201
    records = [agent.evidence.export(request_id) for agent in ring.agents]
    slices = [StageSlice(agent.index, agent.stage.start, agent.stage.end) for agent in ring.agents]
    torch.set_num_threads(threads)
    started = time.perf_counter()
    verdict = blame(
        records,
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=recompute,
        d_model=ring.agents[0].stage.config.d_model,
    )
    elapsed = time.perf_counter() - started
    sizes = [len(record_bytes(record)) / len(sequence) for record in records if record is not None]
    return verdict, elapsed, sizes


def run(ring: ThreadRing, tokenizer: PromptTokenizer, recompute, args: argparse.Namespace, label: str) -> list:  # noqa: ANN001
    rows = []
    for i in range(args.requests):
        request_id, sequence, prompt_len, generated_s = serve(ring, tokenizer, i, args.max_tokens)
        verdict, check_s, sizes = check(ring, request_id, sequence, prompt_len, recompute, args.check_threads)
        rows.append((verdict, generated_s, check_s, sizes, len(sequence) - prompt_len))
        print(
            f"  {label} {i:3d}: {len(sequence) - prompt_len:3d} "
            f"tokens in {generated_s:5.2f} s, check {check_s:5.2f} s, "
            f"errors {[None if e is None else round(e, 5) for e in verdict.errors.values()]}, blamed {verdict.blamed}",
            flush=True,
        )
    return rows


def noisy(layer, level: float, generator: torch.Generator):  # noqa: ANN001, ANN201
    """`layer` with Gaussian noise of `level` times each matrix's own standard deviation."""
    changed = {}
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = getattr(layer, name, None)
        if isinstance(w, torch.Tensor) and w.ndim == 2:
            base = w.float()
            changed[name] = (base + torch.randn(base.shape, generator=generator) * base.std() * level).to(w.dtype)
    return dataclasses.replace(layer, **changed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--check-threads", type=int, default=2)
    parser.add_argument(
        "--noise", default="0.003,0.01,0.03", help="relative noise levels for the coarse copies ('' for none)"
    )
    args = parser.parse_args()
    from llama_cpp import Llama

    path = default_model_path()
    tokenizer = PromptTokenizer(Llama(model_path=str(path), vocab_only=True, verbose=False))
    ranges = split_layers(18, 3)
    limits = Limits(micro_batch=2, row_width=64)
    recompute = stage_recompute(str(path))
    with ThreadRing(path, ranges, limits=limits, slots=2, n_ctx=512) as ring:
        honest = run(ring, tokenizer, recompute, args, "honest")
    stages = build_stages(path, ranges, n_rows=2, n_ctx=512, share_output=True)
    layers = stages[1].weights.layers
    layers[0], layers[1] = (
        dataclasses.replace(layers[0], w_down=layers[1].w_down),
        dataclasses.replace(layers[1], w_down=layers[0].w_down),
    )
    with ThreadRing(path, ranges, limits=limits, slots=2, n_ctx=512, stages=stages) as ring:
        cheat = run(ring, tokenizer, recompute, args, "imitation")
    coarse = {}
    for level in [float(x) for x in args.noise.split(",") if x]:
        stages = build_stages(path, ranges, n_rows=2, n_ctx=512, share_output=True)
        generator = torch.Generator().manual_seed(0)
        stages[1].weights.layers = [noisy(layer, level, generator) for layer in stages[1].weights.layers]
        with ThreadRing(path, ranges, limits=limits, slots=2, n_ctx=512, stages=stages) as ring:
            coarse[level] = run(
                ring,
                tokenizer,
                recompute,
                argparse.Namespace(**{**vars(args), "requests": max(args.requests // 3, 1)}),
                f"noise {level}",
            )

    print(f"\nhonest ring, {len(honest)} requests, tolerance {TOLERANCE}:")
    for index in range(3):
        worst = max(row[0].errors[index] for row in honest)
        print(f"  stage {index}: largest recomputation error {worst:.2e} (tolerance ÷ it: {TOLERANCE / worst:,.0f})")
    wrong = [row[0].blamed for row in honest if row[0].blamed != [0, 2]]
    print(
        f"  a stage's layers blamed: {len(wrong)} of {len(honest)} (what is left, the pick, is blamed only on a miss)"
    )
    print(f"imitating middle stage, {len(cheat)} requests:")
    print(
        f"  its smallest error {min(row[0].errors[1] for row in cheat):.3f}; "
        f"the others' largest {max(max(row[0].errors[0], row[0].errors[2]) for row in cheat):.2e}"
    )
    print(f"  blamed exactly stage 1: {sum(row[0].blamed == [1] for row in cheat)} of {len(cheat)}")
    for level, rows in coarse.items():
        print(
            f"middle stage's weights with noise {level}: its smallest "
            f"error {min(row[0].errors[1] for row in rows):.4f}, "
            f"blamed alone {sum(row[0].blamed == [1] for row in rows)} of {len(rows)}"
        )
    ratios = [row[2] / row[1] for row in honest + cheat]
    print(
        f"check ÷ generation (wall): median {statistics.median(ratios):.3f}, max {max(ratios):.3f} "
        f"(first check includes loading the stages' weights)"
    )
    per_token = [size for row in honest for size in row[3]]
    print(f"evidence per token per stage (npz): median {statistics.median(per_token) / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
