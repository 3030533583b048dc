# Sourced by the setup scripts: installs Python packages into a virtual environment with
# uv (Astral's pip-compatible installer, the one vLLM's install guide recommends), which
# resolves, downloads, links and compiles bytecode in parallel. The four test
# environments took 250-310 s with pip on 2 cores (make envs); uv installs the same
# versions (checked with `pip list` against pip's) in a fraction of that.
#
# Bytecode is compiled at install (--compile-bytecode), as pip does: uv's default leaves
# it to the first import, and where PYTHONDONTWRITEBYTECODE is set (CI images often set
# it) no import ever writes it, so every engine process compiled vLLM and torch from
# source again: a fresh-clone make test took twice as long.
#
#   ensure_uv                      puts a pinned uv in build/uv (pip, once per clone)
#   uv_install VENV ARGS...        `uv pip install` ARGS into VENV (created by the caller)
#   uv_uninstall VENV DISTS...     removes DISTS from VENV if installed
#
# /opt/wheels, where a machine keeps wheels on disk (the CPU torch here), is searched as
# pip's configuration does. UV_CACHE_DIR and the other UV_* variables apply as usual.
UV_VERSION=0.13.9
UV_HOME=${UV_HOME:-build/uv}

_uv_is_pinned() {
  [ -x "$UV_HOME/bin/uv" ] && [ "$("$UV_HOME/bin/uv" --version | cut -d' ' -f2)" = "$UV_VERSION" ]
}

ensure_uv() {
  _uv_is_pinned && return 0
  mkdir -p build
  {
    # the setup scripts run side by side: one of them installs uv, the others wait
    flock -w 300 8 || { echo "waited 5 min for build/.uv.lock; let the other setup finish, then run this again" >&2; exit 1; }
    if ! _uv_is_pinned; then
      python3 -m venv "$UV_HOME"
      "$UV_HOME/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION" \
        2>&1 | grep -v "is ignored" || true
      "$UV_HOME/bin/uv" --version >/dev/null || { echo "uv $UV_VERSION did not install into $UV_HOME" >&2; exit 1; }
    fi
  } 8>build/.uv.lock
}

uv_install() {
  local venv=$1
  shift
  local links=()
  [ -d /opt/wheels ] && links=(--find-links /opt/wheels)
  "$UV_HOME/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" "${links[@]}" "$@"
}

uv_uninstall() {
  local venv=$1
  shift
  "$UV_HOME/bin/uv" pip uninstall --quiet --python "$venv/bin/python" "$@" 2>/dev/null || true
}
