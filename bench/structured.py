"""Grammar-constrained decoding (`response_format`) against free decoding on the shipped
model: tokens per second of each, on the same host runner, interleaved, and their ratio.

    .venv/bin/python bench/structured.py [--rounds 3] [--max-tokens 64] [--threads 2] [--temperature 0]

Each round runs every prompt free, under `json_object` (llama.cpp's JSON grammar), under
a `json_schema` (a person: name, age, hobbies), and free again reporting log-probabilities
(top 5), greedily (or sampled). Speed is completion tokens ÷
wall time of the whole generation (the prompt is short, so this is decode speed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}
FORMATS = {
    "free": None,
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "name": "person", "schema": SCHEMA},
    "free_logprobs": None,
}  # free decoding reporting log-probabilities (top 5): what recording them costs
PROMPTS = [
    "Describe a person as JSON.",
    "Give me a made-up customer record in JSON.",
    "Who is your favourite author? Answer in JSON.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled (seed 7)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="below 1: the nucleus cut, which asks the grammar about every token"
    )
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from catalog.tokenizer import shipped_model_path
    from mahout.runners.llama import LlamaRunner
    from testkit.formats import rendered

    runner = LlamaRunner(shipped_model_path(), threads=args.threads, n_ctx=1024)
    speeds: dict[str, list[float]] = {name: [] for name in FORMATS}
    tokens: dict[str, int] = dict.fromkeys(FORMATS, 0)
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            for name, response_format in FORMATS.items():
                job = rendered(
                    {
                        "model": "gemma-3-270m",
                        "kind": "chat",
                        "messages": [{"role": "user", "content": prompt}],
                        "params": {
                            "max_tokens": args.max_tokens,
                            "temperature": args.temperature,
                            "top_p": args.top_p,
                            "seed": 7,
                            "response_format": response_format,
                            "logprobs": 5 if name == "free_logprobs" else None,
                        },
                    }
                )
                began = time.perf_counter()
                text = "".join(runner.stream(job))
                elapsed = time.perf_counter() - began
                if response_format and runner.finish_reason == "stop":
                    json.loads(text)  # the grammar's answer parses
                speeds[name].append(runner.completion_tokens / elapsed)
                tokens[name] += runner.completion_tokens
    runner.close()
    free = statistics.median(speeds["free"])
    result = {
        name: {
            "median_tokens_per_s": round(statistics.median(values), 1),
            "tokens": tokens[name],
            "ratio_to_free": round(statistics.median(values) / free, 3),
        }
        for name, values in speeds.items()
    }
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "max_tokens": args.max_tokens,
                "threads": args.threads,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "results": result,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
