"""Where the engine thread's wall time goes: per-step phases, per interval and per request.

The engine thread's time splits into segments that never overlap, each counted once
however many requests share it:

- ``submit``: scheduling a step and launching it (drafts, batch metadata, the forward
  queued on the device; on CPU the forward itself runs here, synchronously);
- ``device_wait``: blocking until the step's sampled tokens reach the host (on CUDA the
  part of the forward the host could not hide; about zero on CPU);
- ``commit``: committing tokens (detokenizing, stop checks, cache publication, events);
- ``requests`` and ``publish`` (control work outside steps, counted by the async
  engine): adding and aborting requests, and handing events to the event loop.

A step belongs to the ``prefill`` work class when it computes any prompt token, else
to ``decode``. A request is charged every step it takes part in: in a batch each row
waits for the whole step, so these figures explain one request's latency and must not
be summed across concurrent requests (that is what the interval's :class:`HostWork` is for).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional


@dataclass(frozen=True)
class StepPhases:
    """One finished step's wall-time segments (seconds) and its work class."""

    submit: float
    device_wait: float
    commit: float
    prefill: bool

    @property
    def host(self) -> float:
        return self.submit + self.commit


@dataclass
class RequestExposure:
    """The engine time one request sat through, summed over the steps it took part in."""

    submit_seconds: float = 0.0
    commit_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    steps: int = 0
    #: steps in which this request's row was a decode (or verify) row, and their share
    decode_steps: int = 0
    decode_host_seconds: float = 0.0
    decode_device_wait_seconds: float = 0.0
    #: steps in which this request computed prompt tokens
    prefill_steps: int = 0

    def charge(self, step: StepPhases, decode_row: bool) -> None:
        self.submit_seconds += step.submit
        self.commit_seconds += step.commit
        self.device_wait_seconds += step.device_wait
        self.steps += 1
        if decode_row:
            self.decode_steps += 1
            self.decode_host_seconds += step.host
            self.decode_device_wait_seconds += step.device_wait
        else:
            self.prefill_steps += 1


#: control phases the async engine reports (work outside model steps)
CONTROL_PHASES = ("requests", "publish")


@dataclass
class HostWork:
    """The engine thread's segments over one interval, each counted once."""

    submit: float = 0.0
    commit: float = 0.0
    requests: float = 0.0
    publish: float = 0.0
    device_wait: float = 0.0
    decode_host: float = 0.0
    decode_device_wait: float = 0.0
    prefill_host: float = 0.0
    prefill_device_wait: float = 0.0
    decode_steps: int = 0
    prefill_steps: int = 0
    #: control jobs run (request additions and aborts) and event hand-overs
    request_jobs: int = 0
    publishes: int = 0

    def add_step(self, step: StepPhases) -> None:
        self.submit += step.submit
        self.commit += step.commit
        self.device_wait += step.device_wait
        if step.prefill:
            self.prefill_host += step.host
            self.prefill_device_wait += step.device_wait
            self.prefill_steps += 1
        else:
            self.decode_host += step.host
            self.decode_device_wait += step.device_wait
            self.decode_steps += 1

    def add_control(self, phase: str, seconds: float) -> None:
        if phase == "requests":
            self.requests += seconds
            self.request_jobs += 1
        elif phase == "publish":
            self.publish += seconds
            self.publishes += 1
        else:
            raise ValueError(f"unknown control phase {phase!r}; expected one of {CONTROL_PHASES}")

    @property
    def host_total(self) -> float:
        return self.submit + self.commit + self.requests + self.publish

    def copy(self) -> HostWork:
        return HostWork(**{f.name: getattr(self, f.name) for f in fields(self)})


def per(value: float, count: int) -> Optional[float]:
    """``value / count``, or None when nothing was counted (a normalised figure with no denominator)."""
    return value / count if count else None
