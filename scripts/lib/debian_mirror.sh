# Sourced. `debian_mirror` prints the Debian archive this machine's apt already uses (EVALPLANE_DEBIAN_MIRROR
# overrides): the first URI of a deb line or deb822 entry that is not the security archive. No host is written
# into the project; the machine's own configuration says where its packages come from.
debian_mirror() {
  if [ -n "${EVALPLANE_DEBIAN_MIRROR:-}" ]; then echo "$EVALPLANE_DEBIAN_MIRROR"; return 0; fi
  local uri
  uri=$( { grep -hE '^\s*URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | sed -E 's/^\s*URIs:\s*//' | tr ' ' '\n'
           grep -hE '^\s*deb\s' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
             | sed -E 's/^\s*deb\s+(\[[^]]*\]\s+)?//' | awk '{print $1}'; } \
         | grep -E '^https?://' | grep -v -- '-security' | head -n 1)
  if [ -z "$uri" ]; then
    echo "debian_mirror: no Debian archive in /etc/apt sources; set EVALPLANE_DEBIAN_MIRROR" >&2
    return 1
  fi
  echo "${uri%/}"
}
