"""The gateway's vocabulary copies keep only the BPE merges llama.cpp can apply (issue 28,
`catalog.bpe_merges`): what that drops and saves on every BPE vocabulary llama.cpp publishes,
and a search for any text the copy tokenizes otherwise than the whole file.

For each `ggml-vocab-*.gguf` in the llama-cpp-python sdist that has merges:
1. merges in the file and in the copy `catalog_add` writes (`gguf_vocab_copy`);
2. memory: the RSS a vocabulary-only llama.cpp load of each adds to a fresh process (after
   `malloc_trim`, libraries loaded first);
3. where the copy dropped merges: the token ids of the copy and of the whole file, compared on
   llama.cpp's own test inputs for that vocabulary (`.gguf.inp`), on every Unicode code point
   (surrogates aside) in a context of letters, digits, spaces and an apostrophe, and on
   `--texts` texts spliced from the vocabulary's own tokens, with and without special tokens.
   Any difference is printed; the expected count is 0.

    .venv/bin/python bench/merges.py [--texts 100000] [--models DIR]

`--models`: a folder holding the sdist's `ggml-vocab-*` files (otherwise pip fetches the sdist,
as the tests do). Prints the table; asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from catalog.gguf_file import gguf_facts, gguf_vocab_copy  # noqa: E402
from engine.gguf_meta import _PlainArrayReader, gguf_field  # noqa: E402
from testkit.families import sdist_extract  # noqa: E402

_MEMORY = """
import ctypes, gc, sys
from llama_cpp import Llama
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
warm = Llama(model_path=sys.argv[2], vocab_only=True, verbose=False)  # libraries and llama.cpp's own tables
warm.tokenize(b"warm", add_bos=False)
gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
before = rss()
vocabulary = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
vocabulary.tokenize(b"a first count", add_bos=False)
gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
print(rss() - before)
"""


def vocabularies(folder: Path) -> Path:
    """Every `ggml-vocab-*` file of the sdist, extracted into `folder / "models"`."""
    return sdist_extract(folder, lambda inside: inside.startswith("ggml-vocab-") and "/" not in inside)


def memory_mb(path: Path, warm: Path) -> float:
    found = subprocess.run(
        [sys.executable, "-c", _MEMORY, str(path), str(warm)], check=True, capture_output=True, text=True
    )
    return float(found.stdout.strip().splitlines()[-1])


def merges_count(path: Path) -> int:
    return len(_PlainArrayReader(str(path)).fields["tokenizer.ggml.merges"].data)


def llama_inputs(path: Path) -> list[str]:
    """llama.cpp's own tokenizer test inputs for this vocabulary, if it publishes them."""
    inputs = path.with_name(path.name + ".inp")
    return inputs.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inputs.is_file() else []


def code_point_texts() -> list[str]:
    points = (chr(point) for point in range(0x110000) if not 0xD800 <= point <= 0xDFFF)
    return [f"a{c}b {c}{c}1{c}'s {c}\n{c}" for c in points]


def spliced_texts(path: Path, count: int, seed: int) -> list[str]:
    """Runs of the vocabulary's own tokens (its byte-level spaces and newlines turned back into
    text), cut at a random start: texts a BPE must merge its way through, token edges included."""
    rng = random.Random(seed)
    pieces = [
        text.replace("Ġ", " ").replace("Ċ", "\n").replace("▁", " ")
        for text in gguf_field(_PlainArrayReader(str(path)), "tokenizer.ggml.tokens")
        if text
    ]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 16)))[rng.randint(0, 3) :] for _ in range(count)]


def differences(whole: Path, copy: Path, texts: list[str]) -> tuple[int, list[str]]:
    """How many (text, special) tokenizations differ between the two files, and the first few texts."""
    from llama_cpp import Llama

    a = Llama(model_path=str(whole), vocab_only=True, verbose=False)
    b = Llama(model_path=str(copy), vocab_only=True, verbose=False)
    found, examples = 0, []
    for text in texts:
        data = text.encode("utf-8")
        for special in (False, True):
            if a.tokenize(data, add_bos=False, special=special) != b.tokenize(data, add_bos=False, special=special):
                found += 1
                if len(examples) < 5:
                    examples.append(repr(text))
    return found, examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=100_000, help="spliced texts per vocabulary whose merges were cut")
    parser.add_argument("--models", type=Path, help="a folder with the sdist's ggml-vocab-* files (default: fetch)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="merges-") as temp:
        models = args.models or vocabularies(Path(temp))
        files = sorted(
            path
            for path in models.glob("ggml-vocab-*.gguf")
            if "tokenizer.ggml.merges" in _PlainArrayReader(str(path)).fields
        )
        warm = files[0]
        sweep = code_point_texts()
        print(
            "| vocabulary | merges in file | merges in copy | RSS file MB | RSS copy MB | texts compared | differ | s |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for path in files:
            started = time.perf_counter()
            copy = Path(temp) / f"copy-{path.name}"
            gguf_vocab_copy(path, gguf_facts(path), copy)
            full, kept = merges_count(path), merges_count(copy)
            mem_full, mem_copy = memory_mb(path, warm), memory_mb(copy, warm)
            compared, differ, examples = "(merges unchanged)", "", []
            if kept < full:
                texts = llama_inputs(path) + sweep + spliced_texts(path, args.texts, seed=len(path.name))
                found, examples = differences(path, copy, texts)
                compared, differ = f"{len(texts):,} × 2", str(found)
            print(
                f"| {path.name.removeprefix('ggml-vocab-').removesuffix('.gguf')} | {full:,} | {kept:,} "
                f"| {mem_full:.1f} | {mem_copy:.1f} | {compared} | {differ} | {time.perf_counter() - started:.0f} |",
                flush=True,
            )
            for example in examples:
                print(f"    differs: {example}")


if __name__ == "__main__":
    main()
