"""A ring serves any chat model of the catalog by name (`mahout.ring.model.ring_model`): the
file `mahout add` registered for it (at the bridge and at each stage, from its plan's model),
refused with a clear error when there is none or the engine cannot slice it; and a ring of a
model other than the shipped Gemma (a tiny Qwen 3 with its real vocabulary and chat template,
`testkit.families`) serves a chat job through the host loop, counted and detokenised with
that model's own vocabulary: token for token the engine's single-process greedy text."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.generate import build_stages, generate
from mahout.__main__ import main
from mahout.api import HostApi
from mahout.catalog import CatalogFile, ModelUnavailable, file_sha256
from mahout.model_files import model_add
from mahout.ring.local import ThreadRing, split_layers
from mahout.ring.membership import Limits
from mahout.ring.model import ring_model
from mahout.ring.serve import ring_loops, run_loops
from mahout.runners.embeddings import MODEL_NAME as EMBEDDINGS_MODEL
from mahout.tests.fake_gateway import TOKEN, FakeGateway
from protocol.rendering import chat_format_read
from scorer.llama import PromptTokenizer
from testkit.families import SdistUnavailable, sdist_models, template_path, tiny_model
from testkit.formats import rendered

pytestmark = pytest.mark.usefixtures("one_thread")

QWEN = "tiny-qwen3"  # its name in the (test's) catalog
QWEN_CONTROLS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # what the sdist's Qwen 2 vocabulary marks as control


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A two-layer Qwen 3 with its real vocabulary, and its chat template."""
    try:
        sdist = sdist_models(tmp_path_factory.mktemp("sdist"))
    except SdistUnavailable as exc:
        pytest.skip(str(exc))
    return tiny_model("qwen3", sdist, tmp_path_factory.mktemp("qwen3") / "qwen3.gguf", n_layer=2), template_path(
        "qwen3", sdist
    )


def add(home: Path, path: Path) -> str:
    """Register `path` as catalog model QWEN, as `mahout add` does; returns its sha256."""
    sha256 = file_sha256(path)
    model_add(home, QWEN, path, sha256, entry=CatalogFile(QWEN, "chat", sha256, "F16", context_length=2048).record())
    return sha256


class RingModelTests:
    def test_it_finds_the_file_mahout_add_registered_for_the_name(
        self, qwen3: tuple[Path, Path], tmp_path: Path
    ) -> None:
        path, _ = qwen3
        sha256 = add(tmp_path, path)
        model = ring_model(QWEN, tmp_path)
        assert (model.name, model.path, model.sha256, model.spec.pinned_sha256) == (
            QWEN,
            path.resolve(),
            sha256,
            sha256,
        )

    def test_a_name_neither_shipped_nor_added_is_refused_saying_how_to_add_it(self, tmp_path: Path) -> None:
        with pytest.raises(ModelUnavailable, match="neither shipped with mahout nor added here"):
            ring_model("qwen3-72b", tmp_path)

    def test_the_embeddings_model_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(ModelUnavailable, match="a ring serves chat models"):
            ring_model(EMBEDDINGS_MODEL, tmp_path)

    def test_an_added_file_the_engine_cannot_slice_is_refused(self, tmp_path: Path) -> None:
        junk = tmp_path / "junk.gguf"
        junk.write_bytes(b"GGUF but not really")
        add(tmp_path, junk)
        with pytest.raises(ModelUnavailable, match="cannot be served as a ring"):
            ring_model(QWEN, tmp_path)

    def test_the_command_refuses_an_unknown_name_before_it_forms_a_ring(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        served = main(
            [
                "ring",
                "--stages",
                "2",
                "--server",
                "http://127.0.0.1:9",
                "--token",
                TOKEN,
                "--name",
                "qwen3-72b",
                "--home",
                str(tmp_path),
            ]
        )
        local = main(["ring", "--stages", "2", "--prompt", "hi", "--name", "qwen3-72b", "--home", str(tmp_path)])
        said = capsys.readouterr()
        assert (served, local) == (2, 2)
        assert "qwen3-72b is neither shipped with mahout nor added here" in said.out
        assert "qwen3-72b is neither shipped with mahout nor added here" in said.err

    def test_a_stage_refuses_a_plan_for_a_model_it_has_no_file_for(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`mahout stage` loads the file added for its plan's model; none: a clear refusal."""
        from mahout.tests.test_ring_cli import RingGateway

        with RingGateway() as gateway:
            gateway.model, gateway.n_stages = "qwen3-72b", 2
            code = main(
                [
                    "stage",
                    "--ring",
                    "1",
                    "--stage",
                    "0",
                    "--server",
                    gateway.url,
                    "--token",
                    TOKEN,
                    "--home",
                    str(tmp_path),
                    "--once",
                ]
            )
        assert code == 2
        assert "stage 0 of ring 1: qwen3-72b is neither shipped with mahout nor added here" in capsys.readouterr().out


class RingOfAnotherFamilyTests:
    def test_a_qwen3_ring_serves_a_chat_job_in_its_own_vocabulary(
        self, qwen3: tuple[Path, Path], gateway: FakeGateway, api: HostApi, tmp_path: Path
    ) -> None:
        from llama_cpp import Llama

        path, template = qwen3
        add(tmp_path, path)
        model = ring_model(QWEN, tmp_path)
        fmt = chat_format_read(
            template=template.read_text(encoding="utf-8"),
            bos_token="",
            eos_token="<|endoftext|>",
            adds_bos=False,
            vocabulary_controls=QWEN_CONTROLS,
        )
        gateway.state.add_job("q1", model=QWEN, kind="chat", max_tokens=8, temperature=0.0, fmt=fmt)
        with ThreadRing(model.path, split_layers(2, 2), limits=Limits(4, 16), slots=4, n_ctx=128) as ring:
            loops = ring_loops(
                api,
                ring.bridge,
                model.path,
                parallel=1,
                n_ctx=128,
                fingerprint="f" * 64,
                home=tmp_path,
                name=model.name,
                out=lambda _line: None,
                claim_wait=0.2,
                heartbeat_interval=0.05,
            )
            assert run_loops(loops, max_jobs=1) == 1
        vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
        prompt = PromptTokenizer(vocab).tokens(
            rendered({"kind": "chat", "messages": [{"role": "user", "content": "hi"}]}, fmt)
        )
        (im_start,) = vocab.tokenize(b"<|im_start|>", add_bos=False, special=True)
        assert prompt.count(im_start) >= 2, "the template's control tokens are counted as the model's own single tokens"
        (full,) = build_stages(path, [(0, 2)], n_rows=1, n_ctx=128)
        want = generate([full], prompt, 8).token_ids
        assert gateway.state.status["q1"] == "completed"
        assert gateway.state.completions["q1"]["completion_tokens"] == 8
        assert gateway.state.text["q1"] == vocab.detokenize(want).decode("utf-8", errors="replace")

    def test_a_qwen3_ring_draws_top_p_log_probabilities_and_a_schema_that_its_audit_passes(
        self, qwen3: tuple[Path, Path], tmp_path: Path
    ) -> None:
        """What rings gained in mahout 0.5.0 on a family other than Gemma: the nucleus, the
        log-probabilities and a grammar over Qwen's own 151,936-token vocabulary, passed by the
        llama.cpp verifier with every token checked."""
        from mahout.ring.runner import RingRunner
        from scorer.verify import Verifier

        path, template = qwen3
        fmt = chat_format_read(
            template=template.read_text(encoding="utf-8"),
            bos_token="",
            eos_token="<|endoftext|>",
            adds_bos=False,
            vocabulary_controls=QWEN_CONTROLS,
        )
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
            "additionalProperties": False,
        }
        asks = [
            {"temperature": 0.9, "top_p": 0.9, "logprobs": 2},
            {"temperature": 0.8, "response_format": {"type": "json_schema", "schema": schema}},
        ]
        with (
            ThreadRing(path, split_layers(2, 2), limits=Limits(2, 16), slots=2, n_ctx=128) as ring,
            Verifier(path, threads=1, n_ctx=128) as verifier,
        ):
            assert all(agent.stage.shares_output for agent in ring.agents)
            runner = RingRunner(ring.bridge, path, n_ctx=128)
            for asked in asks:
                job = rendered(
                    {
                        "id": "q",
                        "model": QWEN,
                        "kind": "chat",
                        "prompt": None,
                        "messages": [{"role": "user", "content": "A number, please."}],
                        "params": {"max_tokens": 12, "stop": None, "seed": 21, **asked},
                    },
                    fmt,
                )
                pieces = list(runner.stream(job))
                text = "".join(pieces)
                entries = [entry for piece in pieces for entry in getattr(piece, "logprobs", [])]
                audit = verifier.audit(
                    job,
                    token_ids=runner.token_ids,
                    text=text,
                    finish_reason=runner.finish_reason,
                    seed=21,
                    logprobs=entries if "logprobs" in asked else None,
                )
                assert audit.passed and not audit.misses and audit.checked > 0, (asked, audit)
                if "logprobs" in asked:
                    assert "".join(entry["token"] for entry in entries) == text and len(entries) >= 1
                else:
                    assert text.lstrip().startswith("{")
