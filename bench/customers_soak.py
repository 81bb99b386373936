"""Steady traffic against a running gateway (as `make run` starts it): 6 customers with the `openai`
client, each a streamed chat of 32-128 tokens every 1-3 s, one call in ten an embeddings call.

    python bench/customers_soak.py SECONDS [PORT] [KEY_FILE]   (defaults: 8131, /tmp/fresh/var/demo-api-key)

Prints the answers, tokens, errors by kind and time-to-first-token p50/p95 as JSON.
"""

import json
import random
import sys
import threading
import time

from openai import OpenAI

port = sys.argv[2] if len(sys.argv) > 2 else "8131"
key = open(sys.argv[3] if len(sys.argv) > 3 else "/tmp/fresh/var/demo-api-key").read().strip()
c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
end = time.time() + float(sys.argv[1])
stats = {"ok": 0, "errors": {}, "tokens": 0, "embeddings": 0, "ttft": []}
lock = threading.Lock()


def customer(n):
    rng = random.Random(n)
    while time.time() < end:
        try:
            if rng.random() < 0.1:
                c.embeddings.create(model="all-minilm-l6-v2", input=[f"text {rng.random()}"] * rng.randint(1, 4))
                with lock:
                    stats["embeddings"] += 1
            else:
                t = time.time()
                first = None
                toks = 0
                for ch in c.chat.completions.create(
                    model="gemma-3-270m",
                    stream=True,
                    max_tokens=rng.randint(32, 128),
                    stream_options={"include_usage": True},
                    messages=[
                        {"role": "user", "content": f"Customer {n} asks question {rng.random():.4f} about elephants."}
                    ],
                ):
                    if ch.choices and ch.choices[0].delta.content and first is None:
                        first = time.time() - t
                    if ch.usage:
                        toks = ch.usage.completion_tokens
                with lock:
                    stats["ok"] += 1
                    stats["tokens"] += toks
                    stats["ttft"].append(first or 0)
        except Exception as e:
            key_ = f"{type(e).__name__}:{getattr(e, 'status_code', '')}"
            with lock:
                stats["errors"][key_] = stats["errors"].get(key_, 0) + 1
        time.sleep(rng.uniform(1, 3))


ts = [threading.Thread(target=customer, args=(i,)) for i in range(6)]
[t.start() for t in ts]
[t.join() for t in ts]
tt = sorted(stats["ttft"])
stats["ttft_p50"] = tt[len(tt) // 2] if tt else None
stats["ttft_p95"] = tt[int(len(tt) * 0.95)] if tt else None
del stats["ttft"]
print(json.dumps(stats))
