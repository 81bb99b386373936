"""An audit's cost against the generation it checks, per model shape (issue 29's "audit cost ÷
generation cost, same model and length"), on this machine, one thread each.

Models: the shipped Gemma 3 270M, and the shape of a dense model owners run, Llama 3.2 1B (16
layers, 2,048 wide, 32 heads, 8 KV heads, feed-forward 8,192, Llama 3's real 128,256-token
vocabulary and template) with seeded random weights, written by `testkit.families` and
quantised to Q4_K_M by llama.cpp's own quantiser. The weights do not change what a decode or a
prefill costs, only what it says. The 1B file (0.8 GB) is built once into `--folder`.

For each model, `--answers` honest answers of `--tokens` tokens at temperature 0.7 are streamed
by a host's runner (`LlamaRunner`, the specified sampler); each is audited by the verifier
(`scorer.verify.Verifier`) with `--sample` tokens drawn (`AUDIT_TOKENS`, the default) and with
every token. Printed: the audit seconds ÷ the generation seconds, summed over the answers, and
any audit that failed (an honest answer: 0 expected).

On a machine with a GPU (`bench/gpu_check.sh` runs it so), `--gpu-layers N` offloads N layers
of the host's runner and of the verifier alike (999: every layer), as a GPU host and a GPU
scorer run; each answer is then also audited by a verifier on the CPU (every token), and its
failures are printed apart: honest answers that a machine of the other kind would fail.
`--models shipped` skips the 1B file (it needs the sdist's vocabulary, which pip fetches).

    .venv/bin/python bench/audit_cost.py [--answers 3] [--tokens 256] [--sample 16] [--folder /tmp/audit-cost]
                                         [--gpu-layers 0] [--models shipped,1b]

Fetches the llama-cpp-python sdist (the vocabulary and template) with pip, as the tests do.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# Llama 3.2 1B's blueprint (its config.json), over testkit's llama3 family.
LLAMA_1B = {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_head_kv": 8, "n_ff": 8192, "context_length": 8192}


def llama_1b(folder: Path) -> Path:
    """The Llama 3.2 1B-shaped Q4_K_M file, built unless `folder` has it."""
    import llama_cpp

    from testkit.families import sdist_models, tiny_model

    quantised = folder / "llama-3.2-1b-shape-q4_k_m.gguf"
    if quantised.is_file():
        return quantised
    folder.mkdir(parents=True, exist_ok=True)
    whole = tiny_model("llama3", sdist_models(folder / "sdist"), folder / "llama-3.2-1b-shape-f16.gguf", **LLAMA_1B)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
    partial = quantised.with_name(quantised.name + ".partial")
    if llama_cpp.llama_model_quantize(str(whole).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {whole}")
    partial.rename(quantised)
    whole.unlink()
    return quantised


def measured(path: Path, fmt, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    import trust

    from mahout.runners.llama import LlamaRunner
    from scorer.verify import Verifier
    from testkit.formats import rendered

    runner = LlamaRunner(path, threads=1, n_ctx=2048, gpu_layers=args.gpu_layers)
    verifier = Verifier(path, threads=1, n_ctx=2048, gpu_layers=args.gpu_layers)
    on_cpu = Verifier(path, threads=1, n_ctx=2048) if args.gpu_layers else None  # the other kind of machine
    spent = {"generation": 0.0, "sampled": 0.0, "every": 0.0}
    tokens = failed = failed_on_cpu = 0
    try:
        for index in range(args.answers):
            job = trust.job_for(index, max_tokens=args.tokens, temperature=0.7, top_p=1.0)
            job = rendered({key: value for key, value in job.items() if key not in ("fragments", "end_of_turn")}, fmt)
            answer = trust.answer_of(runner, job)
            spent["generation"] += answer["seconds"]
            tokens += len(answer["token_ids"])
            for name, sample in (("sampled", args.sample), ("every", None)):
                audit, seconds = trust.audited(verifier, job, answer, sample=sample)
                spent[name] += seconds
                failed += bool(audit.reason)
            if on_cpu is not None:
                failed_on_cpu += bool(trust.audited(on_cpu, job, answer)[0].reason)
    finally:
        verifier.close()
        if on_cpu is not None:
            on_cpu.close()
    return {**spent, "tokens": tokens, "failed": failed, "failed_on_cpu": failed_on_cpu if on_cpu else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of each answer")
    parser.add_argument("--sample", type=int, default=16, help="tokens a sampled audit draws (AUDIT_TOKENS)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/audit-cost"), help="where the 1B-shaped file is kept")
    parser.add_argument(
        "--gpu-layers",
        type=int,
        default=0,
        help="layers the host's runner and the verifier offload to a GPU (999: all; 0: the CPU)",
    )
    parser.add_argument("--models", default="shipped,1b", help="which: shipped, 1b, or both (comma-separated)")
    args = parser.parse_args()
    models = set(args.models.split(","))
    if not models or models - {"shipped", "1b"}:
        parser.error(f"--models takes shipped, 1b or both, not {args.models!r}")

    from mahout.model_files import shipped_model_source_path  # (not the engine's: a GPU check's venv may lack torch)
    from testkit.formats import GEMMA, file_format

    started = time.monotonic()
    shapes = {}
    if "shipped" in models:
        shapes["gemma-3-270m (shipped)"] = (shipped_model_source_path(), GEMMA)
    if "1b" in models:
        one_b = llama_1b(args.folder)
        shapes["Llama 3.2 1B shape, Q4_K_M"] = (one_b, file_format(one_b, adds_bos=True))
    where = f"{args.gpu_layers} layers on the GPU" if args.gpu_layers else "the CPU"
    print(f"host and verifier on {where}, one thread each")
    cross = " | failed by a CPU verifier, every token" if args.gpu_layers else ""
    print(
        f"| model | answers (tokens) | generation s | audit ÷ generation, {args.sample} drawn | every token "
        f"| audits failed{cross} |"
    )
    print("|---|---|---|---|---|---|" + ("---|" if cross else ""))
    for name, (path, fmt) in shapes.items():
        row = measured(Path(path), fmt, args)
        print(
            f"| {name} | {args.answers} ({row['tokens']}) | {row['generation']:.1f} "
            f"| {row['sampled'] / row['generation']:.3f} | {row['every'] / row['generation']:.3f} | {row['failed']} |"
            + (f" {row['failed_on_cpu']} |" if cross else ""),
            flush=True,
        )
    print(f"\n{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
