"""A host pushing past `max_tokens` reaches no customer with the surplus: the relay counts
what it has handed over and stops at `max_tokens` (and the counting slack)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from catalog.tokenizer import tokenizer_for
from conftest import ROOT, make_customer, make_host
from marketplace.models import Request
from marketplace.openai.streaming import RequestListener

SHIPPED = "shipped:gemma-3-270m"


class ListenerBoundTests:
    def listener(self, limit: int) -> RequestListener:
        listener = RequestListener.__new__(RequestListener)
        listener.token_limit, listener.tokenizer = limit, tokenizer_for(SHIPPED)
        listener._relayed, listener._piece_tokens = "", 0
        return listener

    def test_text_within_the_limit_passes_whole(self) -> None:
        listener = self.listener(12)
        pieces = [" The", " elephant", " walked", " slowly", " home."]
        assert [listener._within_token_limit(piece) for piece in pieces] == [(piece, False) for piece in pieces]

    def test_the_relay_stops_at_the_limit_however_the_text_comes(self) -> None:
        tokenizer = tokenizer_for(SHIPPED)
        for pieces in ([" grey giant" * 40], [" grey", " giant"] * 40, ["x" * 500]):
            listener = self.listener(10)
            relayed, cut = "", False
            for piece in pieces:
                out, over = listener._within_token_limit(piece)
                relayed += out
                if over:
                    cut = True
                    break
            assert cut and tokenizer.count(relayed, special=False) <= 10 < tokenizer.count(
                "".join(pieces), special=False
            )
            assert tokenizer.count(relayed + pieces[-1][:1], special=False) >= 10  # cut at the limit, not before it


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_host_pushing_past_max_tokens_reaches_the_customer_with_max_tokens_at_most(gateway, catalog) -> None:  # noqa: ANN001
    cheat = make_host(name="chatty", fingerprint="s" * 64)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testkit.simhost",
            "--server",
            gateway.url,
            "--token",
            cheat.token,
            "--model",
            "gemma-3-270m",
            "--loaded",
            "gemma-3-270m",
            "--wait",
            "2",
            "--stream-batches",
            "40",
            "--interval",
            "0.01",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        body = {
            "model": "gemma-3-270m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stream": True,
        }
        text, events = "", []
        with httpx.stream(
            "POST",
            f"{gateway.url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {make_customer().secret}"},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    events.append(event)
                    for choice in event.get("choices") or []:
                        text += choice.get("delta", {}).get("content") or ""
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert text, events
    assert tokenizer_for(SHIPPED).count(text, special=False) <= 8 + 2 + 8 // 8  # max_tokens and the counting slack
    assert "error" in events[-1] or Request.objects.get().status == Request.Status.COMPLETED, events[-1]
