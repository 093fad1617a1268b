#!/bin/sh
# collect_libs.sh PREFIX: copy into PREFIX/lib every shared library an ELF file under PREFIX needs that glibc does not
# provide, and point each ELF file's rpath at PREFIX/lib relative to itself ($ORIGIN), so PREFIX can be moved onto an
# image whose own libraries differ (libssl 1.1 vs 3, libffi 7 vs 8).
set -eu
prefix=$1
lib="$prefix/lib"
glibc='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libutil|libresolv|libcrypt|libnsl)\.'
find "$prefix" -type f \( -name '*.so*' -o -perm -u+x \) | while read -r f; do
  head -c 4 "$f" 2>/dev/null | grep -q 'ELF' || continue
  ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    echo "$name" | grep -Eq "$glibc" && continue
    case "$path" in "$prefix"/*) continue ;; esac
    [ -e "$lib/$name" ] || cp -L "$path" "$lib/$name"
  done
done
find "$prefix" -type f \( -name '*.so*' -o -perm -u+x \) | while read -r f; do
  head -c 4 "$f" 2>/dev/null | grep -q 'ELF' || continue
  dir=$(dirname "$f")
  rel=$(realpath --relative-to="$dir" "$lib")
  patchelf --set-rpath "\$ORIGIN/$rel" "$f" 2>/dev/null || true
done
