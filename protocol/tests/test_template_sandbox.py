"""A chat template is untrusted input: it renders in a sandbox bounded in time, output and memory,
and whatever goes wrong is a TemplateRefused saying why (a 400 for a customer, one line for
`catalog_add`), never an error of the gateway; and it is told the date, as Hugging Face's
`apply_chat_template` and llama.cpp's server tell it, fixed per job."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from protocol import template_sandbox
from protocol.jobs import CHAT, job_payload_build
from protocol.rendering import ChatFormat, TemplateRefused, chat_format_read, chat_fragments, fragments_text

TURNS = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONTROLS = ("<|user|>", "<|assistant|>", "<|end|>")
HI = [{"role": "user", "content": "Hi"}]
# Llama 3.2's and 3.3's own lines: the date from strftime_now where the environment has it
LLAMA_DATE = (
    '{%- if not date_string is defined %}{%- if strftime_now is defined %}'
    '{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}{%- set date_string = "26 Jul 2024" %}'
    '{%- endif %}{%- endif %}Today Date: {{ date_string }}\n' + TURNS
)


def read(template: str) -> ChatFormat:
    return chat_format_read(template=template, bos_token="", eos_token="", adds_bos=False, vocabulary_controls=CONTROLS)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound short enough for a test to wait out."""
    monkeypatch.setattr(template_sandbox, "RENDER_SECONDS", 1.0)


class BoundedTemplateTests:
    def test_it_refuses_a_template_that_loops_when_the_model_is_added(self):
        with pytest.raises(TemplateRefused, match="cannot render"):
            read("{% for i in range(10**9) %}x{% endfor %}" + TURNS)

    def test_it_stops_a_template_that_runs_past_its_time_and_says_so(self, quick):
        looping = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}" + TURNS
        with pytest.raises(TemplateRefused, match="did not finish rendering within 1 s"):
            read(looping)

    def test_a_template_that_loops_for_some_conversations_only_is_refused_for_those(self, quick):
        fmt = read(
            "{% if messages|length > 2 %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
            "{% endfor %}{% endif %}" + TURNS
        )
        assert fragments_text(chat_fragments(fmt, HI)) == "<|user|>Hi<|end|><|assistant|>"
        with pytest.raises(TemplateRefused, match="did not finish"):
            chat_fragments(fmt, HI * 3)
        assert fragments_text(chat_fragments(fmt, HI)) == "<|user|>Hi<|end|><|assistant|>"  # the pool serves on

    def test_it_refuses_a_template_that_writes_without_end(self):
        fmt = read(
            "{% if messages|length > 2 %}{% for i in range(99999) %}{{ 'abcdefghij' * 100 }}{% endfor %}"
            "{% endif %}" + TURNS
        )
        with pytest.raises(TemplateRefused, match="writes more than"):
            chat_fragments(fmt, HI * 3)

    def test_it_refuses_a_template_that_asks_for_too_much_memory_at_once(self):
        with pytest.raises(TemplateRefused, match="memory"):
            chat_fragments(
                read("{% if messages|length > 2 %}{{ ('x' * (messages|length * 10**10))|length }}{% endif %}" + TURNS),
                HI * 3,
            )

    def test_it_refuses_a_template_that_recurses_without_end(self):
        fmt = read(
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{% if messages|length > 2 %}{{ f(0) }}{% endif %}" + TURNS
        )
        with pytest.raises(TemplateRefused, match="recurses"):
            chat_fragments(fmt, HI * 3)

    def test_a_template_cannot_reach_python_through_the_sandbox(self):
        fmt = read(
            "{% if messages|length > 2 %}{{ messages.__class__.__mro__[1].__subclasses__() }}{% endif %}" + TURNS
        )
        with pytest.raises(TemplateRefused, match="cannot render"):
            chat_fragments(fmt, HI * 3)


class TemplateClockTests:
    def test_strftime_now_renders_todays_date(self):
        before = datetime.now(UTC)
        rendered = fragments_text(chat_fragments(read(LLAMA_DATE), HI))
        after = datetime.now(UTC)
        assert rendered.splitlines()[0] in {f"Today Date: {day:%d %b %Y}" for day in (before, after)}
        assert "26 Jul 2024" not in rendered

    def test_a_job_is_rendered_at_the_instant_its_request_fixed(self):
        fixed = datetime(2031, 2, 3, 23, 59, 59, tzinfo=UTC)
        fmt = read("{{ strftime_now('%Y-%m-%d %H:%M:%S') }}|" + TURNS)
        payload = job_payload_build(
            job_id=1,
            model="m",
            kind=CHAT,
            messages=HI,
            prompt=None,
            inputs=None,
            params={"max_tokens": 4},
            fmt=fmt,
            now=fixed,
        )
        again = job_payload_build(
            job_id=2,
            model="m",
            kind=CHAT,
            messages=HI,
            prompt=None,
            inputs=None,
            params={"max_tokens": 4},
            fmt=fmt,
            now=fixed,
        )
        assert fragments_text(payload["fragments"]).startswith("2031-02-03 23:59:59|")
        assert payload["fragments"] == again["fragments"]
        later = chat_fragments(fmt, HI, now=fixed + timedelta(seconds=1))
        assert fragments_text(later).startswith("2031-02-04 00:00:00|")

    def test_llama_cpps_date_string_is_defined_too(self):
        fixed = datetime(2030, 7, 9, tzinfo=UTC)
        rendered = fragments_text(chat_fragments(read("{{ date_string }}|" + TURNS), HI, now=fixed))
        assert rendered.startswith("09 Jul 2030|")
