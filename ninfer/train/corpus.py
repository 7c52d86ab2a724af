"""The training corpus: the Python standard library's own source, which every machine has.

Files are the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (or the tree
``ninfer-train --stdlib`` names: some distributions ship Python without its test suites), without
``site-packages``, without files over ``MAX_FILE_BYTES`` (generated tables and documentation
strings) and, unless asked for (the large preset needs the bytes), without the test suites,
which hold deliberately odd code. Every choice
depends on relative paths only: a file is held out when the CRC-32 of its path is
``0 mod HELDOUT_EVERY``, and each split is read in CRC order (a shuffle that does not
depend on the seed) until its byte budget is spent. The same Python installation
therefore always yields the same texts; another Python version yields other ones.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import attrs

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
MAX_FILE_BYTES = 100_000
HELDOUT_EVERY = 10


@attrs.frozen
class Corpus:
    root: str
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    train_texts: tuple[str, ...]
    heldout_texts: tuple[str, ...]


def _crc(rel: str) -> int:
    return zlib.crc32(rel.encode("utf-8"))


def stdlib_files(root: Path, tests: bool = False) -> list[str]:
    """Relative POSIX paths of the eligible source files under ``root``, sorted."""
    excluded = EXCLUDED_DIRS if tests else EXCLUDED_DIRS | TEST_DIRS
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if excluded & set(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        found.append(rel.as_posix())
    return sorted(found)


def _take(root: Path, files: list[str], budget: int) -> tuple[list[str], list[str]]:
    names, texts, used = [], [], 0
    for rel in sorted(files, key=lambda r: (_crc(r), r)):
        if used >= budget:
            break
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        names.append(rel)
        texts.append(text)
        used += len(text.encode("utf-8"))
    return names, texts


def load_corpus(train_bytes: int, heldout_bytes: int, tests: bool = False, root: Path | None = None) -> Corpus:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root, tests)
    heldout = [f for f in files if _crc(f) % HELDOUT_EVERY == 0]
    train = [f for f in files if _crc(f) % HELDOUT_EVERY != 0]
    train_names, train_texts = _take(root, train, train_bytes)
    held_names, held_texts = _take(root, heldout, heldout_bytes)
    if not train_texts or not held_texts:
        raise RuntimeError(f"no usable standard-library sources under {root}")
    return Corpus(str(root), tuple(train_names), tuple(held_names), tuple(train_texts), tuple(held_texts))

