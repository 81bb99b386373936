"""The operator's own canary prompts (CANARY_PROMPTS_FILE, issue 29): the shipped corpus is
public, so a cheat that reads the repository recognises every canary made of it. A file of the
operator's own replaces it (prompts and system turns), is checked when a process starts, and the
pool page says which one canaries are made of."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.test import Client

from marketplace.lifecycle import canaries
from marketplace.models import CanaryCheck, Request
from marketplace.tests.test_audits_by_hosts import remote_model, scorers
from marketplace.tests.test_live_canaries import make_host

__all__ = ["remote_model", "scorers"]  # (fixtures: a model only trusted hosts hold, and its scorers)

OWN = {
    "prompts": [
        {"kind": "chat", "messages": [{"role": "user", "content": "Which of the moons of Jupiter is largest?"}]},
        {"kind": "completion", "prompt": "Our quarterly report for the Lisbon office shows"},
    ],
    "system_prompts": ["You answer for the Elephant staff canteen."],
}


@pytest.fixture
def staff_client(db: None) -> Client:  # noqa: ARG001
    from django.contrib.auth import get_user_model

    client = Client()
    client.force_login(get_user_model().objects.create(username="operator@example.com", is_staff=True))
    return client


def _written(tmp_path: Path, data: object, name: str = "prompts.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ("{not json", "Expecting property name"),
        ({"prompts": []}, '"prompts" must be a non-empty list'),
        ({"prompts": [{"kind": "embeddings", "input": ["x"]}]}, 'prompt 0: "kind" must be "chat" or "completion"'),
        ([{"kind": "completion", "prompt": "  "}], 'prompt 0: "prompt" must be a non-empty string'),
        (
            [
                {
                    "kind": "chat",
                    "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                }
            ],
            "prompt 0: the last message must be the user's",
        ),
        ([{"kind": "chat", "messages": [{"role": "tool", "content": "{}"}]}], "prompt 0: each message is"),
        ({"prompts": OWN["prompts"], "system_prompts": [""]}, '"system_prompts" must be a list of non-empty strings'),
        ({"prompts": OWN["prompts"], "extra": 1}, "an object with"),
    ],
)
def test_a_bad_prompts_file_is_refused_with_one_line_naming_it(tmp_path, data, says) -> None:  # noqa: ANN001
    path = _written(tmp_path, data)
    with pytest.raises(canaries.CorpusInvalid) as refused:
        canaries.corpus_read(path)
    assert str(refused.value).startswith(f"canary prompts {path}: ") and says in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.django_db
def test_without_a_file_canaries_are_the_public_corpus_and_the_pool_page_says_so(settings, staff_client) -> None:  # noqa: ANN001
    settings.CANARY_PROMPTS_FILE = ""
    assert canaries.corpus_public() and canaries.corpus() == json.loads(canaries.CORPUS.read_text())
    assert canaries.system_prompts() == canaries.SYSTEM_PROMPTS
    page = staff_client.get("/pool/").content.decode()
    assert "made of the shipped public corpus" in page and "set CANARY_PROMPTS_FILE" in page


@pytest.mark.django_db(transaction=True)
@pytest.mark.audits  # (canaries of a model only hosts hold are judged by their audit)
def test_with_the_operators_file_canaries_are_made_of_its_prompts_and_system_turns(
    tmp_path, remote_model, scorers, settings, staff_client
) -> None:  # noqa: ANN001
    settings.CANARY_PROMPTS_FILE = _written(tmp_path, OWN)
    own_prompts = [item.get("prompt") or item["messages"][-1]["content"] for item in OWN["prompts"]]
    newcomer = make_host(name="newcomer")
    seen_system = set()
    for _ in range(12):  # prompts and system turns are drawn at random: each is the operator's
        check = canaries.canary_send(host=newcomer.host)
        assert check is not None and check.by_audit
        request = check.request
        asked = request.prompt if request.kind == Request.Kind.COMPLETION else request.messages[-1]["content"]
        assert asked in own_prompts
        if request.kind == Request.Kind.CHAT:
            seen_system |= {m["content"] for m in request.messages[:-1]}
        CanaryCheck.objects.filter(pk=check.pk).delete()
    assert seen_system <= set(OWN["system_prompts"])
    page = staff_client.get("/pool/").content.decode()
    assert "made of the operator's own prompts (2)" in page and "public corpus" not in page


def _django_started(env: dict) -> subprocess.CompletedProcess:
    """`manage.py check` in a fresh process with `env` added: how every gateway process starts."""
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=django_settings.BASE_DIR,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_process_does_not_start_on_a_missing_or_broken_prompts_file(tmp_path) -> None:  # noqa: ANN001
    missing = _django_started({"CANARY_PROMPTS_FILE": str(tmp_path / "nowhere.json")})
    assert missing.returncode != 0 and "CANARY_PROMPTS_FILE=" in missing.stderr and "no such file" in missing.stderr
    broken = _django_started({"CANARY_PROMPTS_FILE": _written(tmp_path, [{"kind": "chat", "messages": []}])})
    assert broken.returncode != 0 and 'prompt 0: "messages" must be a non-empty list' in broken.stderr
    fine = _django_started({"CANARY_PROMPTS_FILE": _written(tmp_path, OWN, "own.json")})
    assert fine.returncode == 0, fine.stderr
