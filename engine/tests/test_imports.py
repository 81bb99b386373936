from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class EngineImportTests:
    def test_it_never_imports_django(self) -> None:
        code = (
            "import sys, engine, engine.__main__, engine.generate, engine.gguf_loader, engine.model, engine.tokenizer; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'channels')); "
            "assert not bad, bad"
        )
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr

    def test_the_shipped_model_file_comes_without_torch(self) -> None:
        code = (
            "import sys, engine.shipped; bad = sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'django')); assert not bad, bad"
        )
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr

    def test_the_gateway_reads_and_cuts_moe_files_without_torch(self, tmp_path: Path) -> None:
        code = (
            "import sys; from engine.gguf_meta import open_gguf; "
            "from engine.moe_gguf import has_byte_vocabulary, make_tiny_moe, read_moe_config, write_expert_slice; "
            f"path = make_tiny_moe({str(tmp_path / 'tiny.gguf')!r}); reader = open_gguf(path); "
            "assert has_byte_vocabulary(reader) and read_moe_config(reader).n_experts == 8; "
            f"write_expert_slice(path, 1, 2, 3, {str(tmp_path / 'slice.gguf')!r}); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'django')); assert not bad, bad"
        )
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr

    def test_the_gateway_reads_architectures_and_layer_sizes_without_torch(self) -> None:
        code = (
            "import sys, engine.arch; bad = sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'django')); assert not bad, bad"
        )
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
