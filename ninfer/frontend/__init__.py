"""Protocol-neutral handling of model input and output, shared by every protocol adapter.

Among others: :mod:`ninfer.frontend.output_split` turns generated text into reasoning,
answer and tool-call deltas, and :mod:`ninfer.frontend.tool_schema` holds the declared
tools and the rules that type their arguments.
"""
