from __future__ import annotations

import pytest

from engine.__main__ import main


class GenerateCommandTests:
    def test_it_prints_the_greedy_completion(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert (
            main(
                [
                    "generate",
                    "--prompt",
                    "The capital of France is",
                    "--max-tokens",
                    "4",
                    "--threads",
                    "1",
                    "--stages",
                    "2",
                ]
            )
            == 0
        )
        out, err = capsys.readouterr()
        assert out == " the capital of the\n"
        assert "4 generated" in err and "2 stage(s)" in err
