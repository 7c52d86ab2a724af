#!/usr/bin/env bash
# Pack this Python's standard-library sources, test suites included, into .corpus/stdlib.tar.gz
# for a machine whose Python lacks them: `ninfer-train --stdlib DIR` then trains on the same
# files as here. The GPU image's Python 3.12 ships without its tests (session 35: 503 training
# files, 2.1M tokens, so `gpu-deep` saw its corpus ten times in 440 s and over-fitted), where
# the gpu presets were sized for a stdlib with them. Only what the corpus reads is packed:
# .py files up to ninfer.train.corpus.MAX_FILE_BYTES outside site-packages. Run from the
# repository root; gpu_session.sh's spec2 unpacks it when it is carried (.corpus).
#
#   scripts/stdlib_corpus.sh && du -h .corpus/stdlib.tar.gz
set -euo pipefail
mkdir -p .corpus
.venv/bin/python - <<'PY'
import sysconfig, tarfile
from pathlib import Path

from ninfer.train.corpus import stdlib_files

root = Path(sysconfig.get_paths()["stdlib"])
files = stdlib_files(root, tests=True)
with tarfile.open(".corpus/stdlib.tar.gz", "w:gz") as tar:
    for rel in files:
        tar.add(root / rel, arcname=f"{root.name}/{rel}")
print(f"{len(files)} files from {root} in .corpus/stdlib.tar.gz (top directory {root.name}/)")
PY
