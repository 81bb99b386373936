"""What checking every completion's evidence costs the gateway (`marketplace.lifecycle.evidence`),
against what generating the answer cost its host, measured in one run on the shipped model.

    .venv/bin/python bench/evidence_cost.py [--jobs 12] [--max-tokens 96] [--threads 2]

For each job (chats and completions in turn, `bench/trust.py`'s prompts, temperature 0.8), an
honest host (`mahout.runners.llama.LlamaRunner`) generates the answer and reports its token ids;
then, timed on the gateway's side:

- the shape check every completion gets: the ids read from the vocabulary copy
  (`GgufTokenizer.drawn`: in the vocabulary, no end of generation inside, a "stop" that ends
  on one or on a stop string);
- the first-draw check an answer with no text gets: the gateway's verifier recomputes the seed's
  first draw (one prefill of the prompt; `Verifier.audit` on the end of generation alone) —
  here the host's honest first token is checked, which costs what an empty answer's check costs.

Prints the medians and their ratios to the host's generation time; asserts nothing.
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
    from mahout.verify import Verifier

    path = shipped_model_path()
    runner = LlamaRunner(path, threads=args.threads, n_ctx=2048)
    verifier = Verifier(path, threads=args.threads, n_ctx=2048)
    vocab = tokenizer_for("shipped:gemma-3-270m")
    vocab.drawn([1])  # loaded before timing
    generate, shape, first = [], [], []
    for index in range(args.jobs):
        job = job_for(index, max_tokens=args.max_tokens, temperature=0.8, top_p=1.0)
        started = time.perf_counter()
        text = "".join(str(piece) for piece in runner.stream(job))
        generate.append(time.perf_counter() - started)
        ids = list(runner.token_ids)
        started = time.perf_counter()
        drawn = vocab.drawn(ids)
        shape.append(time.perf_counter() - started)
        assert drawn is not None and not drawn.eog_inside, text
        started = time.perf_counter()
        one = {**job, "params": {**job["params"], "max_tokens": 1}}  # the first draw alone, as an empty answer's check
        spelled = verifier._llm.detokenize(ids[:1]).decode("utf-8", errors="ignore")
        result = verifier.audit(one, token_ids=ids[:1], text=spelled, finish_reason="length", seed=int(job["params"]["seed"]),
                                sample=None)
        first.append(time.perf_counter() - started)
        print(f"job {index}: {len(ids)} tokens in {generate[-1]:.2f} s; shape {shape[-1] * 1000:.2f} ms; "
              f"first draw {first[-1] * 1000:.0f} ms ({'passed' if result.reason is None else result.reason})", flush=True)
    gen, sh, fd = statistics.median(generate), statistics.median(shape), statistics.median(first)
    print(f"\n| check | median per job | ÷ the host's generation ({gen:.2f} s, {args.max_tokens} max tokens) |")
    print("|---|---|---|")
    print(f"| shape (every completion) | {sh * 1000:.2f} ms | {sh / gen:.5f} |")
    print(f"| first draw (an answer with no text) | {fd * 1000:.0f} ms | {fd / gen:.3f} |")


if __name__ == "__main__":
    main()
