"""Built-in tool-call parsers (``qwen3_xml``, ``hermes_json``).

Both build on :class:`ninfer.frontend.tool_regions.TaggedToolParser`; each module is
its own entry point in the ``ninfer`` group.
"""
