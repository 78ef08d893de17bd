# Sourced by scripts/setup.sh and scripts/setup_sglang.sh (which set PIP to the venv's pip).
#
#   install_into VENV ARGS...    # as `pip install ARGS...` into VENV
#
# Uses uv (`python -m uv pip install`, installed into the venv by the caller): it downloads and
# unpacks in parallel, and installed SGLang's dependencies in 19 s where pip took about 200 s
# (2 cores, no cache). Where uv is missing or fails (no route to its index, an option it does not
# know), pip installs the same, so set-up never depends on uv. MILES_SETUP_PIP=1 uses pip only.
# uv reads no pip configuration: wheels pip would take from this machine's disk (torch) are
# installed with pip first, and the caller pins them with a constraints file.
install_into() {
  local venv="$1"; shift
  if [ -z "${MILES_SETUP_PIP:-}" ] && "$venv/bin/python" -m uv --version >/dev/null 2>&1; then
    local nocache=(); [ -n "${PIP_NO_CACHE_DIR:-}" ] && nocache=(UV_NO_CACHE=1)  # as pip's setting asks
    # --compile-bytecode: uv writes no .pyc by default (pip does), and where PYTHONDONTWRITEBYTECODE is set
    # nothing writes them later, so every process compiled what it imported from source, each time: a Ray
    # actor 1.5 s more to start, an SGLang server process about 12 s (measured on 2 cores)
    if env "${nocache[@]}" "$venv/bin/python" -m uv pip install -q --compile-bytecode --python "$venv/bin/python" "$@"; then
      return 0
    fi
    echo "setup: uv could not install '$*'; installing with pip" >&2
  fi
  "${PIP[@]}" install -q "$@"
}
