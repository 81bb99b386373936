"""What checking every completion's evidence costs the gateway (`marketplace.lifecycle.evidence`),
against what generating the answer cost its host, measured in one run on the shipped model.

    .venv/bin/python bench/evidence_cost.py [--jobs 12] [--max-tokens 96] [--threads 2]

For each job (chats and completions in turn, `bench/trust.py`'s prompts, temperature 0, 0.7 and
1.2 at top_p 1 and 0.8 at top_p 0.9 in turn), an
honest host (`mahout.runners.llama.LlamaRunner`) generates the answer and reports its token ids;
then, timed on the gateway's side:

- the shape check every completion gets: the ids read from the vocabulary copy
  (`GgufTokenizer.drawn`: in the vocabulary, no end of generation inside, a "stop" that ends
  on one or on a stop string);
- the first-draw check an answer with no text gets: the gateway's verifier recomputes the seed's
  first draw (one prefill of the prompt; `Verifier.audit` on the end of generation alone) —
  here the host's honest first token is checked, which costs what an empty answer's check costs.

Prints the medians and their ratios to the host's generation time, and every honest answer
either check refused (false positives: there should be none); asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


SETTINGS = [(0.0, 1.0), (0.7, 1.0), (1.2, 1.0), (0.8, 0.9)]  # temperature, top_p, in turn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import django

    django.setup()
    from bench.trust import job_for
    from catalog.tokenizer import shipped_model_path, tokenizer_for
    from mahout.runners.llama import LlamaRunner
    from marketplace.lifecycle.evidence import shape_problem
    from protocol.jobs import job_stop_strings
    from scorer.verify import Verifier

    path = shipped_model_path()
    runner = LlamaRunner(path, threads=args.threads, n_ctx=2048)
    verifier = Verifier(path, threads=args.threads, n_ctx=2048)
    vocab = tokenizer_for("shipped:gemma-3-270m")
    vocab.drawn([1])  # loaded before timing
    generate, shape, first, refused = [], [], [], []
    for index in range(args.jobs):
        temperature, top_p = SETTINGS[index % len(SETTINGS)]
        job = job_for(index, max_tokens=args.max_tokens, temperature=temperature, top_p=top_p)
        started = time.perf_counter()
        text = "".join(str(piece) for piece in runner.stream(job))
        generate.append(time.perf_counter() - started)
        ids = list(runner.token_ids)
        started = time.perf_counter()
        problem = shape_problem(
            vocab,
            token_ids=ids,
            own_text=text,
            finish_reason=runner.finish_reason,
            stops=lambda job=job: job_stop_strings(job),
        )
        shape.append(time.perf_counter() - started)
        if problem is not None:
            refused.append((index, "shape", problem))
        started = time.perf_counter()
        one = {**job, "params": {**job["params"], "max_tokens": 1}}  # the first draw alone, as an empty answer's check
        ended = vocab.drawn(ids[:1]).ended  # an honest empty answer: its first draw ended it
        spelled = "" if ended else verifier._llm.detokenize(ids[:1]).decode("utf-8", errors="ignore")
        result = verifier.audit(
            one,
            token_ids=ids[:1],
            text=spelled,
            finish_reason="stop" if ended else "length",
            seed=int(job["params"]["seed"]),
            sample=None,
        )
        first.append(time.perf_counter() - started)
        if result.reason is not None:
            refused.append((index, "first draw", result.reason))
        if index % 25 and index != args.jobs - 1:
            continue
        print(
            f"job {index}: {len(ids)} tokens in {generate[-1]:.2f} s; shape {shape[-1] * 1000:.2f} ms; "
            f"first draw {first[-1] * 1000:.0f} ms ({'passed' if result.reason is None else result.reason})",
            flush=True,
        )
    gen, sh, fd = statistics.median(generate), statistics.median(shape), statistics.median(first)
    print(f"\n| check | median per job | ÷ the host's generation ({gen:.2f} s, {args.max_tokens} max tokens) |")
    print("|---|---|---|")
    print(f"| shape (every completion) | {sh * 1000:.2f} ms | {sh / gen:.5f} |")
    print(f"| first draw (an answer with no text) | {fd * 1000:.0f} ms | {fd / gen:.3f} |")
    print(f"\nhonest answers refused: {len(refused)} of {args.jobs} (shape) and of {args.jobs} (first draw)")
    for index, check, why in refused:
        print(f"  job {index}, {check}: {why}")


if __name__ == "__main__":
    main()
