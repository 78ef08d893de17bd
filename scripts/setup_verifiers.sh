#!/usr/bin/env bash
# Set up verifiers for `task=verifiers`: its own virtual environment inside the clone, where miles' runner
# (miles/agent/verifiers_runner.py) loads a verifiers environment and plays its episodes against the
# run's rollout server (miles itself never imports verifiers).
#
#   scripts/setup_verifiers.sh [VENV_DIR]      # default: <repo>/.venv-verifiers (gitignored)
#
# verifiers 0.4.0 pulls openai, anthropic, its prime-* packages and an MCP stack (no torch); it lives apart
# from .venv so that none of them changes what miles runs with. Add your environment's own packages to
# this venv. A second run finds the stamp file and only re-checks.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-verifiers}"
PYTHON="${PYTHON:-python3}"
VERIFIERS_VERSION=0.4.0
STAMP="$VENV/.miles-verifiers-setup"
t0=$SECONDS
want="verifiers==$VERIFIERS_VERSION"
check() {
  "$VENV/bin/python" -c "import verifiers.v1; \
from importlib.metadata import version; print('setup_verifiers: verifiers', version('verifiers'), 'in', '$VENV')"
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  check
  echo "setup_verifiers: already set up ($((SECONDS - t0)) s)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
. "$ROOT/scripts/install.sh"
"${PIP[@]}" install -q --upgrade pip uv
install_into "$VENV" "verifiers==$VERIFIERS_VERSION"
check
echo "$want" > "$STAMP"
echo "setup_verifiers: done in $((SECONDS - t0)) s; $(du -sh "$VENV" | cut -f1) in $VENV"
