#!/usr/bin/env bash
# Set up OpenEnv for the `openenv` tests and examples/openenv_largest: its own virtual environment inside
# the clone, where an OpenEnv environment server runs (miles itself talks to such a server over HTTP and
# WebSocket and never imports openenv).
#
#   scripts/setup_openenv.sh [VENV_DIR]      # default: <repo>/.venv-openenv (gitignored)
#
# openenv-core 0.3.0 pulls gradio, fastmcp and pandas (no torch); it lives apart from .venv so that none
# of them changes what miles runs with (scripts/install.sh: side_venv).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
. "$ROOT/scripts/install.sh"
side_venv setup_openenv "${1:-$ROOT/.venv-openenv}" openenv-core==0.3.0 "openenv.core.env_server.http_server, uvicorn"
