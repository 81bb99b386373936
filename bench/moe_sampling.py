"""What a grammar and log-probabilities cost an MoE coordinator, per token, in one run.

The tiny qwen3moe of `testkit.families` (Qwen 3's real 151,936-token vocabulary and chat
template, 3 layers of 8 experts, 2 per token), served by `MoeRunner` in this process (one
slot, every expert local). Each round asks the same chat these ways, at T 0.7 with the same
seed, up to `--tokens` tokens:

- free text (the baseline),
- under `response_format: json_object` (llama.cpp's grammar over the vocabulary; the draw is
  `protocol.sampling.select_masked`'s, which asks the grammar about the likeliest tokens first),
- with `logprobs` and 5 `top_logprobs` (a log-softmax over the vocabulary and the best 5 each
  step, text cut on token boundaries);

and free text and json_object again greedy (T 0), each against free text at its temperature.

Rounds alternate so machine noise hits every side; the median ms per token of each, and its
ratio to free text, are printed. The tiny model's layers cost little, so its vocabulary-wide
work (the head, the sampler) is most of a step: on a real model the same overhead is a far
smaller share. Its random weights also give a flat distribution, where the masked draw can
rarely be settled among the likeliest tokens and asks the grammar about all of them: a
trained model's peaked one settles early (as a single-machine host's does; the rule is
the same, `protocol.sampling`). Nothing is asserted: the figures go into BENCHMARKS.md.

    .venv/bin/python bench/moe_sampling.py [--rounds 15] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()

    import torch

    from mahout.moe.runner import MoeRunner
    from protocol.rendering import chat_fragments
    from testkit.families import sdist_models, tiny_model
    from testkit.formats import file_format

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="moe-sampling-"))
    print("building the tiny qwen3moe (the llama-cpp-python sdist's Qwen vocabulary)...", flush=True)
    path = tiny_model("qwen3moe", sdist_models(folder / "sdist"), folder / "qwen3moe.gguf", n_layer=3)
    fmt = file_format(path, adds_bos=False)
    runner = MoeRunner(path, n_slots=1, n_ctx=512)
    messages = [{"role": "user", "content": "Describe an elephant in JSON."}]
    base = {
        "kind": "chat",
        "messages": messages,
        "fragments": [list(f) for f in chat_fragments(fmt, messages)],
        "end_of_turn": list(fmt.end_of_turn),
        "continuation": False,
    }
    sides = {
        "free text": {},
        "response_format json_object": {"response_format": {"type": "json_object"}},
        "logprobs, top 5": {"logprobs": 5},
        "free text, greedy": {"temperature": 0.0},
        "response_format json_object, greedy": {"response_format": {"type": "json_object"}, "temperature": 0.0},
    }
    timings: dict[str, list[float]] = {name: [] for name in sides}
    runner.tokenizer.pieces(runner.config.vocab_size)  # (made once per process: not a per-token cost)
    for round_index in range(args.rounds + 1):  # the first round warms up and is not counted
        for name, extra in sides.items():
            params = {
                "max_tokens": args.tokens,
                "temperature": 0.7,
                "top_p": 1.0,
                "stop": None,
                "seed": 7 + round_index,
                **extra,
            }
            slot = runner.slot()
            started = time.perf_counter()
            for _ in slot.stream({**base, "params": params}):
                pass
            elapsed = time.perf_counter() - started
            if round_index and slot.completion_tokens:
                timings[name].append(1000 * elapsed / slot.completion_tokens)
    runner.close()
    print(f"\n{args.rounds} rounds, up to {args.tokens} tokens each, 1 torch thread\n")
    print("| sampling | ms per token (median) | ÷ free text at its temperature |")
    print("|---|---|---|")
    for name, values in timings.items():
        baseline = statistics.median(timings["free text, greedy" if "greedy" in name else "free text"])
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / baseline:.2f} |")


if __name__ == "__main__":
    main()
