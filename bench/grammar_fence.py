"""What converting a schema behind the fence costs a host or a gateway (issue 30).

    .venv/bin/python bench/grammar_fence.py [--schemas 60]

llama-cpp-python's JSON-schema converter called directly (the baseline, in this process)
against the same converter behind `protocol.grammar_fence` (a child process, a pipe each way),
on the same schemas, in the same run: the fence's one-off start, each new schema's median,
their ratio, and a schema seen before (answered from the fence's cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: E402

from protocol.grammar_fence import GrammarFence  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=60)
    args = parser.parse_args()
    schemas = [
        json.dumps(
            {
                "type": "object",
                "required": ["k0"],
                "properties": {f"k{i}": {"type": "string", "maxLength": 20 + n} for i in range(5)},
            }
        )
        for n in range(args.schemas + 1)
    ]
    fence = GrammarFence(memory_mb=1024)
    started = time.perf_counter()
    fence.convert(schemas[0], seconds=10)
    cold = time.perf_counter() - started

    def median(convert) -> float:  # noqa: ANN001
        took = []
        for schema in schemas[1:]:
            started = time.perf_counter()
            convert(schema)
            took.append(time.perf_counter() - started)
        return statistics.median(took)

    direct = median(json_schema_to_gbnf)
    fenced = median(lambda schema: fence.convert(schema, seconds=10))
    cached = median(lambda schema: fence.convert(schema, seconds=10))
    fence.close()
    print(
        f"fence start {cold * 1000:.0f} ms (once per process); a new schema: direct {direct * 1000:.2f} ms, "
        f"fenced {fenced * 1000:.2f} ms ({fenced / direct:.2f}x); a schema seen before: {cached * 1e6:.0f} µs"
    )


if __name__ == "__main__":
    main()
