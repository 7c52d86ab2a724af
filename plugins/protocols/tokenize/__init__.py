"""vLLM's tokenizer endpoints: POST /tokenize and POST /detokenize.

Evaluation harnesses and proxies built for vLLM probe these to count and split prompts
with the server's own tokenizer and chat template (lm-evaluation-harness, for one).
"""

from ninfer.capabilities import Protocol
from ninfer.hookspecs import hookimpl


@hookimpl
def register_protocols(register):
    register(Protocol(name="tokenize", description="vLLM's POST /tokenize and POST /detokenize", routes=_routes))


def _routes(state):
    # Imported on use: listing plugins, checking profiles and the batch runner never
    # need the web stack.
    from ninfer_plugins.protocols.tokenize.routes import tokenize_routes

    return tokenize_routes(state)
