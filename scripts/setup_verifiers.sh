#!/usr/bin/env bash
# Set up verifiers for `task=verifiers`: its own virtual environment inside the clone, where miles' runner
# (miles/agent/verifiers_side/runner.py) loads a verifiers environment and plays its episodes against the
# run's rollout server (miles itself never imports verifiers).
#
#   scripts/setup_verifiers.sh [VENV_DIR]      # default: <repo>/.venv-verifiers (gitignored)
#
# verifiers 0.4.0 pulls openai, anthropic, its prime-* packages and an MCP stack (no torch); it lives apart
# from .venv so that none of them changes what miles runs with (scripts/install.sh: side_venv). Add your
# environment's own packages to this venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
. "$ROOT/scripts/install.sh"
side_venv setup_verifiers "${1:-$ROOT/.venv-verifiers}" verifiers==0.4.0 verifiers.v1
