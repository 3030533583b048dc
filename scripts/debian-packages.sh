# Sourced by scripts/setup.sh and scripts/setup-sglang.sh: installs the Debian packages
# Mooncake's transfer engine links (libibverbs, libnl) when they are missing, as root or
# through sudo; otherwise exits naming the apt-get command. Uses the caller's `log`.
ensure_debian_packages() {
  local debs="libibverbs1 libnl-3-200 libnl-route-3-200" missing="" p sudo
  for p in $debs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  [ -n "$missing" ] || return 0
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
    echo "missing Debian packages:$missing; install them as root: apt-get install -y$missing" >&2; exit 1
  fi
  log "installing Debian packages:$missing"
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q $missing >/dev/null
}
