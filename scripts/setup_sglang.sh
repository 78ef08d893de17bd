#!/usr/bin/env bash
# Set up SGLang for `rollout=sglang`: its own virtual environment inside the clone.
#
#   scripts/setup_sglang.sh [VENV_DIR]      # default: <repo>/.venv-sglang (gitignored)
#
# sglang 0.5.23 pins torch 2.14.1 and transformers 5.19.0 exactly, so it lives apart from the main
# venv; miles starts the SGLang server with this venv's interpreter and talks to it over HTTP.
# Steps: a venv; torch 2.14.1 (pip takes the wheel from this machine's disk where there is one);
# sglang 0.5.23 with torch pinned by scripts/sglang/constraints.txt (installed with uv, or pip where
# uv cannot: scripts/install.sh); a stand-in libcuda.so.1 built
# from scripts/sglang/libcuda_stub.c into <venv>/lib/miles-libcuda (sgl_kernel's wheel links against
# libcuda.so.1; the engine puts the stand-in on LD_LIBRARY_PATH only where there is no GPU); then
# a check that sglang and sgl_kernel import. A second run finds the stamp file and only re-checks.
#
# Afterwards `python -m miles rollout=sglang` finds <repo>/.venv-sglang by itself; elsewhere set
# MILES_SGLANG_PYTHON=/path/to/venv/bin/python or rollout.engine.python=/path/to/venv/bin/python.
# Needs: python3 with venv (3.10-3.12), gcc, a package index. Measured on 2 shared cores: 99 s with
# uv, no cache (4-6.5 min with pip alone), 10 GB on disk; a second run takes ~20 s.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
CONSTRAINTS="$ROOT/scripts/sglang/constraints.txt"
STUB_SRC="$ROOT/scripts/sglang/libcuda_stub.c"
STUB_DIR="$VENV/lib/miles-libcuda"
STAMP="$VENV/.miles-sglang-setup"
t0=$SECONDS

want="sglang==$SGLANG_VERSION torch==$TORCH_VERSION $(cat "$CONSTRAINTS" "$STUB_SRC" | sha256sum | cut -c1-16)"
check() {
  LD_LIBRARY_PATH="$STUB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" SGLANG_USE_CPU_ENGINE=1 \
    "$VENV/bin/python" -c "import torch, sglang, sgl_kernel; \
print('setup_sglang: sglang', sglang.__version__, 'torch', torch.__version__, 'in', '$VENV')"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  check
  echo "setup_sglang: already set up ($((SECONDS - t0)) s)"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
. "$ROOT/scripts/install.sh"
"${PIP[@]}" install -q --upgrade pip uv
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
echo "setup_sglang: torch installed ($((SECONDS - t0)) s)"
install_into "$VENV" -c "$CONSTRAINTS" "sglang==$SGLANG_VERSION"
echo "setup_sglang: sglang installed ($((SECONDS - t0)) s)"
mkdir -p "$STUB_DIR"
gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$STUB_DIR/libcuda.so.1" "$STUB_SRC"
check
echo "$want" > "$STAMP"
echo "setup_sglang: done in $((SECONDS - t0)) s; $(du -sh "$VENV" | cut -f1) in $VENV"
