# Sourced by the scripts that install Debian packages. `apt_install PKG...` waits for another apt/dpkg run to
# finish instead of failing on its lock: ours (scripts run side by side, e.g. docker.sh up beside
# registry.sh) queue on one flock; anyone else's, through apt's own lock timeout (DPkg::Lock::Timeout, which
# `apt-get update`'s lists lock does not honour on every apt: hence the flock, and a retry of the update).
_apt_sudo=""; [ "$(id -u)" -eq 0 ] || _apt_sudo=sudo
apt_install() {
  local lock=(-o DPkg::Lock::Timeout=600)
  (
    flock -w 900 9 || echo "apt: waited 15 min for another of our apt runs; trying anyway" >&2
    local i
    for i in 1 2 3 4 5 6; do
      $_apt_sudo apt-get "${lock[@]}" update -qq && break
      [ "$i" -lt 6 ] || exit 1  # (the subshell's status is the function's)
      echo "apt: update failed (another apt run holds its lock?); again in 10 s" >&2
      sleep 10
    done
    $_apt_sudo env DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" install -y -qq "$@" >&2
  ) 9>"${TMPDIR:-/tmp}/evalplane-apt.lock"
}
