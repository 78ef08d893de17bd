#!/usr/bin/env bash
# Set up OpenEnv for the `openenv` tests and examples/openenv_largest: its own virtual environment inside
# the clone, where an OpenEnv environment server runs (miles itself talks to such a server over HTTP and
# WebSocket and never imports openenv).
#
#   scripts/setup_openenv.sh [VENV_DIR]      # default: <repo>/.venv-openenv (gitignored)
#
# openenv-core 0.3.0 pulls gradio, fastmcp and pandas (no torch); it lives apart from .venv so that none
# of them changes what miles runs with. A second run finds the stamp file and only re-checks.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-openenv}"
PYTHON="${PYTHON:-python3}"
OPENENV_VERSION=0.3.0
STAMP="$VENV/.miles-openenv-setup"
t0=$SECONDS
want="openenv-core==$OPENENV_VERSION"
check() {
  "$VENV/bin/python" -c "import openenv.core.env_server.http_server, uvicorn; \
from importlib.metadata import version; print('setup_openenv: openenv-core', version('openenv-core'), 'in', '$VENV')"
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  check
  echo "setup_openenv: already set up ($((SECONDS - t0)) s)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
. "$ROOT/scripts/install.sh"
"${PIP[@]}" install -q --upgrade pip uv
install_into "$VENV" "openenv-core==$OPENENV_VERSION"
check
echo "$want" > "$STAMP"
echo "setup_openenv: done in $((SECONDS - t0)) s; $(du -sh "$VENV" | cut -f1) in $VENV"
