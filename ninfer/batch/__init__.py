"""Offline batch inference over the input-format JSON (the ``ninfer-run`` command).

:mod:`~ninfer.batch.schema` validates a file, :mod:`~ninfer.batch.runner` runs it on an
:class:`ninfer.LLM`, :mod:`~ninfer.batch.output` builds and writes the results. Only the
schema is imported here, so validating needs no torch.
"""

from ninfer.batch.schema import BatchInput, BatchInputError, BatchRequest, parse_batch, parse_batch_json

__all__ = ["BatchInput", "BatchInputError", "BatchRequest", "parse_batch", "parse_batch_json"]
