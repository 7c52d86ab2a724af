"""A request's validated ``guided_decoding`` object as the engine's :class:`GuideSpec`.

:mod:`ninfer.batch.schema` has already checked the shape (exactly one mode, the value's
type, escaped JSON that parses); this only unwraps it. The spec's ``param`` is the JSON
path of the mode's value, so a schema or pattern the backend refuses is reported there.
"""

from __future__ import annotations

import json
from typing import Any

from ninfer.guided.spec import GuideSpec

#: modes whose value may arrive as an escaped JSON string
_JSON_VALUED = ("json_schema", "structural_tag", "choice")


def guide_spec(guide: dict[str, Any], path: str) -> GuideSpec:
    """``guide`` holds one validated mode; ``path`` is where the object sits in the file."""
    ((mode, value),) = guide.items()
    if mode == "json_object":
        value = None  # the value only switches the mode on: any JSON object
    elif mode in _JSON_VALUED and isinstance(value, str):
        value = json.loads(value)
    return GuideSpec(mode, value, param=f"{path}.{mode}")
