"""Triton compiles, counted and timed, and named when one happens while serving.

A Triton kernel is compiled once per distinct set of compile-time values (block shapes
from a tuned table, flags, the integer specialisations of its size arguments). A compile
inside a step stalls every request in it, for up to seconds on a fresh machine (the disk
cache makes restarts cheap). The warm-up (:mod:`.warmup`) is meant to compile everything
serving needs; this watch checks that it did: after the warm-up, each compile is logged
as a warning with the kernel's name and what was new about it, so a shape the warm-up
misses is seen rather than felt as a stray slow request.

Triton calls ``knobs.runtime.jit_cache_hook`` before a compile (an in-memory cache miss,
even when the disk cache then supplies the binary) and ``jit_post_compile_hook`` after.
The watch chains to hooks already set. Under the interpreter nothing is compiled.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from loguru import logger


class CompileWatch:
    """Counts the compiles since :meth:`install`; warns of each one once :attr:`serving`."""

    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0
        self.serving = False
        #: per kernel (its function's name): compiles and seconds since install
        self.by_kernel: dict[str, tuple[int, float]] = {}
        self._started: dict[int, float] = {}
        self._knobs: Any = None
        self._previous: tuple[Any, Any] = (None, None)

    def install(self) -> bool:
        """Hook into Triton; False where this Triton has no compile hooks."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        self._knobs = runtime
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        return True

    def heaviest(self, since: Optional[dict[str, tuple[int, float]]] = None, top: int = 3) -> str:
        """The ``top`` kernels by compile seconds since ``since`` (an earlier copy of
        :attr:`by_kernel`), as "name xN (S s)" joined by commas: where a cold start's time
        goes (an autotuned kernel compiles every candidate config)."""
        since = since or {}
        grown = []
        for name, (count, seconds) in self.by_kernel.items():
            count0, seconds0 = since.get(name, (0, 0.0))
            if count > count0:
                grown.append((seconds - seconds0, count - count0, name))
        grown.sort(reverse=True)
        return ", ".join(f"{name} x{count} ({seconds:.1f} s)" for seconds, count, name in grown[:top])

    def uninstall(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._previous
            self._knobs = None

    def _before(self, **kwargs: Any) -> Optional[bool]:
        self._started[id(kwargs.get("key"))] = time.perf_counter()
        earlier = self._previous[0]
        return earlier(**kwargs) if earlier is not None else None  # truthy would skip the compile

    def _after(self, **kwargs: Any) -> Any:
        started = self._started.pop(id(kwargs.get("key")), None)
        seconds = time.perf_counter() - started if started is not None else 0.0
        self.compiles += 1
        self.seconds += seconds
        fn = kwargs.get("fn")
        name = getattr(fn, "name", "?") if fn is not None else "?"
        count, total = self.by_kernel.get(name, (0, 0.0))
        self.by_kernel[name] = (count + 1, total + seconds)
        if self.serving:
            logger.warning("compiled Triton kernel {} while serving ({:.2f} s): the warm-up did not cover {}",
                           _name(kwargs), seconds, _what(kwargs))
        later = self._previous[1]
        return later(**kwargs) if later is not None else None


def _name(hook_kwargs: dict) -> str:
    fn = hook_kwargs.get("fn")
    return f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}" if fn is not None else "?"


def _what(hook_kwargs: dict, limit: int = 1500) -> str:
    """This variant's compile-time values: launch options, each constexpr's value and each
    integer argument's type, marked ``%16`` where Triton specialised it as a multiple of 16
    (Triton's own description lists the arguments wrongly in 3.6), cut to ``limit``."""
    info = hook_kwargs.get("compile") or {}
    signature = info.get("signature") or {}
    constants = info.get("constants") or {}
    attrs = (info.get("configs") or [{}])[0] or {}
    parts = []
    for i, (name, kind) in enumerate(signature.items()):
        if kind == "constexpr":
            parts.append(f"{name}={constants.get((i,), '?')}")
        elif not str(kind).startswith("*"):
            sixteen = any("divisibility" in str(a) for a in attrs.get((i,), ()))
            parts.append(f"{name}: {kind}{' %16' if sixteen else ''}")
    text = f"num_warps={info.get('num_warps')}, num_stages={info.get('num_stages')}; {', '.join(parts)}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_WATCH: Optional[CompileWatch] = None


def process_watch() -> Optional[CompileWatch]:
    """The process's one watch, installed at the first call (every engine built in the
    process shares it: Triton's hooks are global); None where Triton has no hooks."""
    global _WATCH
    if _WATCH is None:
        watch = CompileWatch()
        if not watch.install():
            return None
        _WATCH = watch
    return _WATCH
