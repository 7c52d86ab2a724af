"""The results document and how it reaches disk.

The file is written to a temporary sibling and moved over the target with one
``os.replace``, so readers see either the previous file or the complete new one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ninfer.batch.runner import BatchRun, RequestResult
from ninfer.batch.schema import BatchInput


def result_json(result: RequestResult) -> dict[str, Any]:
    """One request's entry: its text and counts, or its error."""
    out: dict[str, Any] = {"index": result.index}
    if result.error is not None:
        out.update(finish_reason="error", error=result.error)
    else:
        out.update(output_text=result.output_text, finish_reason=result.finish_reason)
        if result.finish_reason in ("stop-words", "end-of-sequence"):
            out["stop_reason"] = result.stop_reason
    out.update(
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        generated_tokens=result.generated_tokens,
    )
    if result.logprobs is not None and result.error is None:
        out["logprobs"] = [
            [{"token_id": c.token_id, "token": c.token, "bytes": c.bytes, "logprob": c.logprob} for c in step]
            for step in result.logprobs
        ]
    timings = {"first_token_s": result.first_token_s, "total_s": result.total_s}
    out["timings"] = {k: round(v, 6) for k, v in timings.items() if v is not None}
    return out


def summary_json(run: BatchRun, batch: BatchInput, model: str, load_seconds: float) -> dict[str, Any]:
    """Counts, timings and throughput of the whole run."""
    results = run.results
    generated = sum(r.generated_tokens for r in results)
    seconds = run.seconds
    return {
        "model": model,
        "requests": len(results),
        "succeeded": sum(r.error is None for r in results),
        "failed": sum(r.error is not None for r in results),
        "batch_size": run.batch_size,  # decoded together; a warning says when batch_size was more
        "sampling": run.sampling,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "cached_tokens": sum(r.cached_tokens for r in results),
        "generated_tokens": generated,
        "load_seconds": round(load_seconds, 6),
        "seconds": round(seconds, 6),
        "output_tokens_per_second": round(generated / seconds, 3) if seconds > 0 else 0.0,
        "requests_per_second": round(len(results) / seconds, 3) if seconds > 0 else 0.0,
        "speculative_decoding": {
            "backend": run.spec_backend,  # None: no speculative decoder loaded
            "proposal_sampling": batch.spec_proposal_sampling,
            "requests_disabling": run.spec_decode_disabled,
            "rounds": run.spec_rounds,
            "draft_tokens": run.spec_drafted,
            "accepted_tokens": run.spec_accepted,
            # tokens each verify round committed: the kept drafts plus the target's own
            "acceptance_length": round((run.spec_accepted + run.spec_rounds) / run.spec_rounds, 4)
            if run.spec_rounds else None,
        },
        "warnings": [*batch.warnings, *run.warnings],
    }


def output_document(run: BatchRun, batch: BatchInput, model: str, load_seconds: float) -> dict[str, Any]:
    return {
        "results": [result_json(r) for r in run.results],
        "summary": summary_json(run, batch, model, load_seconds),
    }


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as JSON to ``path`` all at once, or not at all."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's private 0600 would otherwise stick to the result
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
