"""The call markers Qwen's chat templates (and Hermes') wrap tool calls in: one call per pair."""

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
