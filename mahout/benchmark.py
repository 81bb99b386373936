"""Real benchmark of a model on this machine, and its cache.

A host may claim a model only after benchmarking it on this very machine, so the numbers
come from llama.cpp running the actual GGUF: prompt throughput, time to first token,
generation throughput and resident memory; for the embeddings model, from
sentence-transformers embedding real sentences: inputs and tokens per second, the latency
of one input, and memory. Results are cached in
``<home>/qualifications.json`` keyed by (model, machine fingerprint, model sha256), so a
restart does not re-benchmark; a different thread count counts as a miss.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from mahout.gpu import Offload

N_CTX = 2048
PROMPT_TOKENS = 200
GEN_TOKENS = 32
_PROMPT_TEXT = (
    "The history of the elephant is long and varied. Elephants live in families led by the "
    "oldest female, travel great distances in search of water, and remember the routes for "
    "decades. Their trunks hold more than forty thousand muscles. "
)
QUALIFICATIONS_FILE = "qualifications.json"


def rss_mb() -> float:
    """Resident memory of this process in MiB (VmRSS), or the peak RSS where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompt_tokens(llm, count: int) -> list[int]:
    """Exactly ``count`` tokens (BOS first) of plain English text."""
    text = _PROMPT_TEXT * (count // 30 + 2)
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)[:count]


def _measure_prompt(llm, tokens: list[int]) -> float:
    """Prompt tokens per second: one batched eval of the whole prompt from an empty cache."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens)
    return len(tokens) / (time.perf_counter() - start)


def _measure_generation(llm, tokens: list[int], count: int) -> tuple[float, float]:
    """Greedy-generate ``count`` tokens; return (time to first token ms, generation tokens/s).

    The cache is reset first so the first token pays for the full prompt, as a job's would.
    Generation speed counts the tokens after the first over the time after the first.
    """
    llm.reset()
    start = time.perf_counter()
    first = end = start
    produced = 0
    for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        produced += 1
        end = time.perf_counter()
        if produced == 1:
            first = end
        if produced >= count:
            break
    return (first - start) * 1000, (produced - 1) / max(end - first, 1e-9)


def run_benchmark(model_path: Path, threads: int, *, progress: bool = True, offload: Offload | None = None) -> dict:
    """Load the model with ``threads`` threads (and `offload`'s layers on the GPU) and measure
    it; returns the result dict, which says where it ran."""
    from scorer.llama import load_llama

    offload = offload or Offload(0, 0, 0.0, "cpu")
    with tqdm(total=3, desc="benchmark", unit="phase", disable=not progress) as bar:
        bar.set_postfix_str("loading")
        loading = time.perf_counter()
        llm = load_llama(model_path, n_ctx=N_CTX, threads=threads, gpu_layers=offload.layers)
        load_ms = (time.perf_counter() - loading) * 1000
        bar.update(1)
        tokens = _prompt_tokens(llm, PROMPT_TOKENS)
        bar.set_postfix_str(f"prompt ({len(tokens)} tokens)")
        prompt_tps = _measure_prompt(llm, tokens)
        bar.update(1)
        bar.set_postfix_str(f"generation ({GEN_TOKENS} tokens)")
        ttft_ms, gen_tps = _measure_generation(llm, tokens, GEN_TOKENS)
        bar.update(1)
    memory_mb = rss_mb()
    llm.close()
    return {
        "prompt_tps": round(prompt_tps, 1),
        "gen_tps": round(gen_tps, 1),
        "ttft_ms": round(ttft_ms, 1),
        "memory_mb": round(memory_mb, 1),
        "threads": threads,
        "load_ms": round(load_ms, 1),  # the gateway's start bound for a job on a cold host
        "device": offload.device,
        "gpu_layers": offload.layers,
        "vram_mb": offload.vram_mb,
    }


EMBED_INPUTS = 128
EMBED_BATCH = 16
EMBED_LATENCY_RUNS = 5
_EMBED_SENTENCES = (
    "Elephants live in families led by the oldest female.",
    "The herd travelled for days in search of water, following routes the matriarch remembered.",
    "A trunk holds more than forty thousand muscles.",
    "Rain came late that year, and the river was low; the calves drank first while the adults kept watch.",
)


def embedding_inputs(count: int) -> list[str]:
    """``count`` English sentences of mixed length (roughly 10 to 50 tokens each)."""
    return [" ".join(_EMBED_SENTENCES[: 1 + i % len(_EMBED_SENTENCES)]) for i in range(count)]


def _measure_latency(runner, text: str, runs: int) -> float:
    """Median milliseconds to embed one input on its own (an interactive caller's wait)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        runner.embed([text])
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def _measure_throughput(runner, texts: list[str], bar: tqdm) -> tuple[float, float]:
    """Embed ``texts`` in batches; return (inputs/s, input tokens/s)."""
    tokens, elapsed = 0, 0.0
    for first in range(0, len(texts), EMBED_BATCH):
        batch = texts[first : first + EMBED_BATCH]
        start = time.perf_counter()
        runner.embed(batch)
        elapsed += time.perf_counter() - start
        tokens += runner.prompt_tokens
        bar.update(len(batch))
        bar.set_postfix_str(f"{tokens / elapsed:.0f} tok/s")
    return len(texts) / elapsed, tokens / elapsed


def run_embeddings_benchmark(
    model_dir: Path, threads: int, *, progress: bool = True, offload: Offload | None = None
) -> dict:
    """Load the embeddings model with ``threads`` threads and measure it.

    The gateway's qualification body has one shape for every model: embedded input tokens
    per second go into both ``prompt_tps`` and ``gen_tps``, and the latency of embedding
    one input into ``ttft_ms``. ``memory_mb`` is what loading and running the model added
    to this process's resident memory (torch included, when it was not imported yet).
    """
    from mahout.runners.embeddings import EmbeddingsRunner

    before = rss_mb()
    texts = embedding_inputs(EMBED_INPUTS)
    with tqdm(total=EMBED_INPUTS, desc="benchmark embeddings", unit="input", disable=not progress) as bar:
        bar.set_postfix_str("loading")
        loading = time.perf_counter()
        runner = EmbeddingsRunner(model_dir, threads)
        runner.embed(texts[:2])  # warm-up: the first call pays for lazy initialisation
        load_ms = (time.perf_counter() - loading) * 1000
        bar.set_postfix_str("latency")
        latency_ms = _measure_latency(runner, texts[1], EMBED_LATENCY_RUNS)
        bar.reset()  # the bar's own rate then shows the throughput phase alone
        inputs_per_s, tokens_per_s = _measure_throughput(runner, texts, bar)
    memory_mb = max(rss_mb() - before, 0.0)
    runner.close()
    return {
        "prompt_tps": round(tokens_per_s, 1),
        "gen_tps": round(tokens_per_s, 1),
        "ttft_ms": round(latency_ms, 1),
        "memory_mb": round(memory_mb, 1),
        "threads": threads,
        "load_ms": round(load_ms, 1),
        "inputs_per_s": round(inputs_per_s, 1),
    }


def _cache_key(model: str, fingerprint: str, sha256: str) -> str:
    return f"{model}|{fingerprint}|{sha256}"


def load_cached(
    home: Path, model: str, fingerprint: str, sha256: str, threads: int, gpu_layers: int = 0
) -> dict | None:
    """The cached result for this model, machine, file, thread count and GPU offload, or ``None``."""
    try:
        cache = json.loads((home / QUALIFICATIONS_FILE).read_text())
    except (OSError, ValueError):
        return None
    result = cache.get(_cache_key(model, fingerprint, sha256))
    fits = isinstance(result, dict) and result.get("threads") == threads and result.get("gpu_layers", 0) == gpu_layers
    return result if fits else None


def store_cached(home: Path, model: str, fingerprint: str, sha256: str, result: dict) -> None:
    """Record a result, keeping other entries."""
    path = home / QUALIFICATIONS_FILE
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache[_cache_key(model, fingerprint, sha256)] = result
    path.write_text(json.dumps(cache, indent=2, sort_keys=True))


def qualify(
    home: Path,
    model: str,
    model_path: Path,
    sha256: str,
    fingerprint: str,
    threads: int,
    *,
    rebenchmark: bool = False,
    progress: bool = True,
    measure: Callable[..., dict] | None = None,
    offload: Offload | None = None,
) -> tuple[dict, bool]:
    """Return ``(result, from_cache)``: the cached benchmark, or a fresh one (then cached).

    ``measure(model_path, threads, progress=…, offload=…)`` runs the benchmark; the llama.cpp one by default.
    """
    cached = (
        None
        if rebenchmark
        else load_cached(home, model, fingerprint, sha256, threads, offload.layers if offload else 0)
    )
    if cached is not None:
        return cached, True
    placed = {"offload": offload} if offload is not None else {}  # (a model that runs on the CPU is measured as before)
    result = (measure or run_benchmark)(model_path, threads, progress=progress, **placed)
    store_cached(home, model, fingerprint, sha256, result)
    return result, False
