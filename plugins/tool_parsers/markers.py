"""The call markers Qwen's chat templates (and Hermes') wrap tool calls in: one call per pair."""

from ninfer.frontend.tool_grammar import CallMarkers

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
#: the same markers in a grammar: each tag is one added token, and calls sit one per line
TOOL_CALL_GRAMMAR = CallMarkers('<tool_call> "\\n"', '"\\n" </tool_call>', TOOL_CALL_OPEN, separator='"\\n"')
