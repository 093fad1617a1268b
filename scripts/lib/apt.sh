# Sourced by the scripts that install Debian packages. `apt_install PKG...` waits up to 10 min for another
# apt/dpkg run to finish (scripts run side by side, e.g. docker.sh up beside build_dataplane.sh) instead of
# failing on the lock.
_apt_sudo=""; [ "$(id -u)" -eq 0 ] || _apt_sudo=sudo
apt_install() {
  local lock=(-o DPkg::Lock::Timeout=600)
  $_apt_sudo apt-get "${lock[@]}" update -qq \
    && $_apt_sudo env DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" install -y -qq "$@" >&2
}
