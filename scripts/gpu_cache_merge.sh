#!/usr/bin/env bash
# Merge the Triton binaries a device call brought back (DIR/triton.tar.gz, or its
# triton.tar.gz.part-* pieces) into .tcache/triton.tar.gz, which the next call carries
# (see the top of scripts/gpu_session.sh). Run from the repository root:
#
#   scripts/gpu_cache_merge.sh /work/.device/5
set -euo pipefail
dir=${1:?usage: scripts/gpu_cache_merge.sh DIR, the files_at of a device call}
shopt -s nullglob
parts=("$dir"/triton.tar.gz.part-*)
[ -f "$dir/triton.tar.gz" ] && parts=("$dir/triton.tar.gz")
[ ${#parts[@]} -gt 0 ] || { echo "no Triton archive in $dir"; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p .tcache "$work/cache"
[ -f .tcache/triton.tar.gz ] && tar -xzf .tcache/triton.tar.gz -C "$work/cache"
before=$(find "$work/cache" -mindepth 1 -maxdepth 1 | wc -l)
cat "${parts[@]}" | tar -xz -C "$work/cache"
# the IR files older archives carried are never read on a cache hit: keep binaries, metadata and launchers
find "$work/cache" -type f ! -name '*.json' ! -name '*.cubin' ! -name '*.so' -delete
tar -czf "$work/merged.tar.gz" -C "$work/cache" .
chmod u+w .tcache/triton.tar.gz 2>/dev/null || true
mv "$work/merged.tar.gz" .tcache/triton.tar.gz
echo "$(find "$work/cache" -mindepth 1 -maxdepth 1 | wc -l) kernels cached ($before before)," \
    "$(du -h .tcache/triton.tar.gz | cut -f1) in .tcache/triton.tar.gz"
