"""Where an audit's time goes: the verifier's batched prefill per token against a host's
one-token decode, on one CPU thread (issue 29's "audit cost ÷ generation cost").

An audit is one prefill of prompt + answer with logits at the drawn positions only
(`scorer.verify.Verifier._replay`); a host's generation is one decode step per token. This
times both on the same file, same tokens, same thread, taking the best of `--rounds`:

- prefill of `--tokens` tokens with 16 logit rows (what an audit of 16 drawn tokens asks) and
  with 1 (the body alone);
- decode of 100 tokens one at a time, each with its logits (what a host runs).

`--q5-as-q8` also writes a copy of the file whose Q5_0 matrices are re-encoded as Q8_0 without
loss (the same scale per block of 32, each 5-bit value minus 16 as a signed byte: the integer
dot products llama.cpp computes are the same), checks that the two give the same logits on a
prompt, and times the copy alike. The shipped Gemma's matrices are mostly Q5_0, since 640 is not
a multiple of the K-quants' 256.

`--loop SECONDS` only prefills again and again, for a profiler to watch:

    .venv/bin/python bench/verifier_prefill.py --loop 25 &
    py-spy record --native --pid $! --duration 12 --format raw -o prefill.txt

    .venv/bin/python bench/verifier_prefill.py [--model PATH] [--tokens 300] [--rounds 3] [--q5-as-q8]

Asserts nothing; prints a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

Q5_0_BLOCK, Q8_0_BLOCK, BLOCK_VALUES = 22, 34, 32  # bytes per block of 32 values: f16 scale, then the values


def q5_0_as_q8_0(raw):  # type: ignore[no-untyped-def]
    """Q5_0 blocks (bytes) as Q8_0 blocks with the same values: d, then (q - 16) as int8."""
    import numpy as np

    blocks = raw.reshape(-1, Q5_0_BLOCK)  # (n, 22): d f16, qh u32 (the fifth bits), qs 16 bytes (two nibbles each)
    fifth = blocks[:, 2:6].copy().view("<u4")[:, 0]  # (n,)
    nibbles = blocks[:, 6:]  # (n, 16): value j low, value j + 16 high
    shifts = np.arange(16, dtype=np.uint32)
    low = (nibbles & 0x0F).astype(np.int16) | (((fifth[:, None] >> shifts) & 1).astype(np.int16) << 4)
    high = (nibbles >> 4).astype(np.int16) | (((fifth[:, None] >> (shifts + 16)) & 1).astype(np.int16) << 4)
    values = np.concatenate([low, high], axis=1) - 16  # (n, 32) in [-16, 15]
    out = np.empty((len(blocks), Q8_0_BLOCK), dtype=np.uint8)  # (n, 34)
    out[:, :2] = blocks[:, :2]
    out[:, 2:] = values.astype(np.int8).view(np.uint8)
    return out


def write_q5_as_q8(source: Path, target: Path) -> int:
    """`source` copied to `target` with every Q5_0 tensor re-encoded as Q8_0; returns how many."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    writer = GGUFWriter(target, arch=reader.fields["general.architecture"].contents(), endianess=reader.endianess)
    for name, entry in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = entry.types[0]
        writer.add_key_value(
            name, entry.contents(), kind, sub_type=entry.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    recoded = 0
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.tensor_type == GGMLQuantizationType.Q5_0:
            rows = [int(n) for n in reversed(tensor.shape.tolist())][:-1]
            row_bytes = int(tensor.shape[0]) // BLOCK_VALUES * Q8_0_BLOCK
            data = q5_0_as_q8_0(data.view(np.uint8).reshape(-1)).reshape([*rows, row_bytes])
            writer.add_tensor(tensor.name, data, raw_dtype=GGMLQuantizationType.Q8_0)
            recoded += 1
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return recoded


class Timer:
    """One model on one thread, timed as a verifier prefills and as a host decodes."""

    def __init__(self, path: Path, tokens: int) -> None:
        import llama_cpp

        from scorer.llama import load_llama

        self.lib = llama_cpp
        self.llm = load_llama(path, n_ctx=max(512, tokens + 16), threads=1)
        self.tokens = [1000 + index * 7919 % 20_000 for index in range(tokens)]  # ids every vocabulary here holds
        self.batch = llama_cpp.llama_batch_init(len(self.tokens), 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.llm.close()

    def _decode(self, tokens: list[int], start: int, rows: set[int]) -> None:
        batch = self.batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = start + i in rows
        if self.lib.llama_decode(self.llm.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def prefill_ms(self, rows: int) -> float:
        """ms per token of one prefill of every token with `rows` logit rows (the last ones, spread)."""
        count = len(self.tokens)
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.llm.ctx), True)
        began = time.perf_counter()
        self._decode(self.tokens, 0, set(range(count - 1, count - 1 - rows * 17, -17)))
        return (time.perf_counter() - began) * 1000 / count

    def decode_ms(self, steps: int = 100) -> float:
        """ms per token decoding `steps` tokens one at a time, each with its logits."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.llm.ctx), True)
        began = time.perf_counter()
        for position in range(steps):
            self._decode([self.tokens[position]], position, {position})
        return (time.perf_counter() - began) * 1000 / steps

    def logits(self, count: int = 24):  # type: ignore[no-untyped-def]
        """Every logit row of a prefill of the first `count` tokens."""
        import numpy as np

        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.llm.ctx), True)
        self._decode(self.tokens[:count], 0, set(range(count)))
        n_vocab = self.llm.n_vocab()
        return np.stack(
            [
                np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.llm.ctx, i), shape=(n_vocab,)).copy()
                for i in range(count)
            ]
        )


def timed(path: Path, args: argparse.Namespace) -> dict:
    timer = Timer(path, args.tokens)
    try:
        return {
            "drawn": min(timer.prefill_ms(16) for _ in range(args.rounds)),
            "body": min(timer.prefill_ms(1) for _ in range(args.rounds)),
            "decode": min(timer.decode_ms() for _ in range(args.rounds)),
        }
    finally:
        timer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a GGUF (default: the shipped model)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens prefilled (prompt + answer)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--q5-as-q8", action="store_true", help="also time a copy with Q5_0 re-encoded as Q8_0")
    parser.add_argument("--loop", type=float, default=0.0, help="only prefill for this many seconds (for a profiler)")
    args = parser.parse_args()
    if args.tokens < 120 or args.rounds < 1:
        parser.error("--tokens must be at least 120 (16 rows 17 apart) and --rounds at least 1")
    from mahout.model_files import shipped_model_source_path

    path = args.model or shipped_model_source_path()
    if args.loop:
        timer, until = Timer(path, args.tokens), time.monotonic() + args.loop
        while time.monotonic() < until:
            timer.prefill_ms(1)
        timer.close()
        return
    files = {"as published": path}
    with tempfile.TemporaryDirectory(prefix="verifier-prefill-") as folder:
        if args.q5_as_q8:
            copy = Path(folder) / "q5-as-q8.gguf"
            recoded = write_q5_as_q8(path, copy)
            original, again = Timer(path, args.tokens), Timer(copy, args.tokens)
            try:
                difference = float(abs(original.logits() - again.logits()).max())
            finally:
                original.close()
                again.close()
            print(
                f"{recoded} Q5_0 matrices re-encoded as Q8_0; largest "
                f"logit difference over 24 positions: {difference:g}"
            )
            files["Q5_0 as Q8_0"] = copy
        print(f"{path.name}, {args.tokens} tokens, one thread, best of {args.rounds}")
        print(
            "| file | prefill ms/token, 16 logit rows | 1 row | decode "
            "ms/token | prefill ÷ decode | prefill ÷ the published file's |"
        )
        print("|---|---|---|---|---|---|")
        base = None
        for name, file in files.items():
            row = timed(file, args)
            base = base or row["drawn"]
            print(
                f"| {name} | {row['drawn']:.2f} | {row['body']:.2f} | {row['decode']:.2f} "
                f"| {row['drawn'] / row['decode']:.3f} | {row['drawn'] / base:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
