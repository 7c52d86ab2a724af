#!/usr/bin/env bash
# Fill .whl/ with the wheels the GPU machine's image lacks (it has torch, triton and
# transformers, and no network): scripts/gpu_session.sh installs them from there, so carry
# .whl with every device call. The versions are the ones the CPU venv runs; the platform
# tags are the GPU image's (CPython 3.12, x86-64 glibc).
#
#   scripts/gpu_wheels.sh            # into .whl/ (existing wheels are kept)
#   scripts/gpu_wheels.sh /tmp/w     # elsewhere
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
packages=(
    litestar==2.25.0 litestar-htmx==0.5.0 multipart==2.0.1 msgspec==0.23.0 cattrs==26.2.1 loguru==0.7.3
    llguidance==1.9.1 sniffio==1.3.1 uvicorn==0.55.0 polyfactory==3.5.0 rich-click==1.9.9 faker==40.63.0
    flash-linear-attention==0.6.0 fla-core==0.6.0
)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dest" "${packages[@]}"
ls "$dest"
