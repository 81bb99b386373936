"""`python -m engine generate --prompt TEXT --max-tokens K [--threads N] [--stages S]`
`python -m engine make-tiny-moe PATH [--seed N]`: write a small qwen3moe GGUF (see engine.moe_gguf)

Runs the model in one process (split into S chained stages if asked), greedy by default,
prints the completion on stdout and timings on stderr.
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine.device import add_device_argument
from engine.generate import build_stages, even_split, generate
from engine.gguf_loader import default_model_path, read_config
from engine.gguf_meta import open_gguf
from engine.tokenizer import Tokenizer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete a prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    gen.add_argument("--model", default=None, help="GGUF path (default: the shipped Gemma 3 270M)")
    gen.add_argument("--stages", type=int, default=1, help="split the layers into this many chained stages")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--n-ctx", type=int, default=1024)
    add_device_argument(gen)
    tiny = commands.add_parser("make-tiny-moe", help="write a small MoE GGUF with seeded random weights")
    tiny.add_argument("path")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def _make_tiny_moe(args: argparse.Namespace) -> int:
    from engine.moe_gguf import make_tiny_moe

    print(make_tiny_moe(args.path, seed=args.seed))
    return 0


def _generate(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    tokenizer = Tokenizer(model_path)
    config = read_config(open_gguf(model_path))
    stages = build_stages(
        model_path, even_split(config.n_layers, args.stages), n_rows=1, n_ctx=args.n_ctx, device=args.device
    )
    prompt_ids = tokenizer.encode(args.prompt)
    result = generate(
        stages,
        prompt_ids,
        args.max_tokens,
        stop_ids=(tokenizer.eos_id,),
        temperature=args.temperature,
        generator=torch.Generator().manual_seed(args.seed),
    )
    print(tokenizer.decode(result.token_ids))
    print(
        f"prompt {len(prompt_ids)} tokens in {result.prefill_s:.3f} s; "
        f"{len(result.token_ids)} generated, decode {result.decode_tokens_per_s:.1f} tokens/s "
        f"({torch.get_num_threads()} threads, {len(stages)} stage(s), on {args.device})",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "make-tiny-moe":
        return _make_tiny_moe(args)
    return _generate(args)


if __name__ == "__main__":
    raise SystemExit(main())
