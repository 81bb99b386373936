"""Exact Gemma 3 renderings: turns, system merge, list content, open continuation."""
from __future__ import annotations

import pytest

from protocol.turns import STOP_STRINGS, render_chat, render_completion, render_job


class RenderChatTests:
    def test_it_renders_a_user_turn_ready_for_the_model(self):
        assert render_chat([{"role": "user", "content": "Hi"}]) == (
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        )

    def test_it_renders_a_conversation_with_assistant_as_model(self):
        messages = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
        ]
        assert render_chat(messages) == (
            "<start_of_turn>user\nHi<end_of_turn>\n"
            "<start_of_turn>model\nHello!<end_of_turn>\n"
            "<start_of_turn>user\nHow are you?<end_of_turn>\n"
            "<start_of_turn>model\n"
        )

    def test_it_prepends_system_messages_to_the_first_user_turn(self):
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Speak French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Salut"},
            {"role": "user", "content": "Again"},
        ]
        assert render_chat(messages) == (
            "<start_of_turn>user\nBe brief.\n\nSpeak French.\n\nHi<end_of_turn>\n"
            "<start_of_turn>model\nSalut<end_of_turn>\n"
            "<start_of_turn>user\nAgain<end_of_turn>\n"
            "<start_of_turn>model\n"
        )

    def test_it_joins_the_text_parts_of_list_content(self):
        content = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {}},
                   {"type": "text", "text": "this."}]
        assert render_chat([{"role": "user", "content": content}]) == (
            "<start_of_turn>user\nDescribe this.<end_of_turn>\n<start_of_turn>model\n"
        )

    def test_it_leaves_a_final_assistant_turn_open_for_continuation(self):
        messages = [
            {"role": "user", "content": "Name a fruit"},
            {"role": "assistant", "content": "Banan"},
        ]
        assert render_chat(messages) == (
            "<start_of_turn>user\nName a fruit<end_of_turn>\n<start_of_turn>model\nBanan"
        )

    def test_it_never_emits_bos(self):
        assert "<bos>" not in render_chat([{"role": "user", "content": "x"}])

    def test_it_rejects_an_unknown_role(self):
        with pytest.raises(ValueError, match="tool"):
            render_chat([{"role": "tool", "content": "x"}])


class RenderJobTests:
    def test_it_renders_a_completion_unchanged(self):
        assert render_completion("Once upon a") == "Once upon a"
        assert render_job({"kind": "completion", "prompt": "Once upon a", "messages": None}) == "Once upon a"

    def test_it_dispatches_chat_jobs(self):
        job = {"kind": "chat", "messages": [{"role": "user", "content": "Hi"}], "prompt": None}
        assert render_job(job).endswith("<start_of_turn>model\n")
        assert STOP_STRINGS == ["<end_of_turn>"]

    def test_it_rejects_an_unknown_kind(self):
        with pytest.raises(ValueError, match="embedding"):
            render_job({"kind": "embedding"})
