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

# A venv of its own for one Python package that miles talks to from outside (an environment server, a
# runner), never imports, and keeps apart from .venv so that its dependencies change nothing miles runs with:
#
#   side_venv NAME VENV REQUIREMENT MODULE    # e.g. side_venv setup_openenv "$VENV" openenv-core==0.3.0 openenv
#
# creates VENV (with python3, or $PYTHON), installs REQUIREMENT with uv (pip where uv fails), checks that
# MODULE imports and writes a stamp file; a second run with the same REQUIREMENT finds the stamp and only
# re-checks. NAME prefixes its lines.
side_venv() {
  local name="$1" venv="$2" requirement="$3" module="$4"
  local stamp="$venv/.miles-side-venv" t0=$SECONDS
  local check=("$venv/bin/python" -c "import $module; from importlib.metadata import version; \
print('$name: $requirement'.split('==')[0], version('$requirement'.split('==')[0]), 'in', '$venv')")
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$requirement" ] && [ -x "$venv/bin/python" ]; then
    "${check[@]}"
    echo "$name: already set up ($((SECONDS - t0)) s)"
    return 0
  fi
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  rm -f "$stamp"
  PIP=("$venv/bin/python" -m pip --disable-pip-version-check)
  "${PIP[@]}" install -q --upgrade pip uv
  install_into "$venv" "$requirement"
  "${check[@]}"
  echo "$requirement" > "$stamp"
  echo "$name: done in $((SECONDS - t0)) s; $(du -sh "$venv" | cut -f1) in $venv"
}
