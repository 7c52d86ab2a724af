"""OpenAI's legacy text completions (POST /v1/completions): raw prompts, no chat template.

Prompts may be a string, a list of strings, a list of token ids or a list of such
lists; each prompt gets ``n`` choices, indexed prompt-major. Log probabilities use the
legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).
``echo`` prepends the prompt to the text; with log probabilities too, the engine scores
the prompt and its tokens lead the log probabilities (the first has nothing before it to
predict it, so its entries are null). With ``max_tokens: 0`` that is exactly what
evaluation harnesses use to compute a text's likelihood.
"""

from ninfer.capabilities import Protocol
from ninfer.hookspecs import hookimpl


@hookimpl
def register_protocols(register):
    register(Protocol(name="openai_completions", description="OpenAI legacy text completions (/v1/completions)",
                      routes=_routes))


def _routes(state):
    # Imported on use: listing plugins, checking profiles and the batch runner never
    # need the web stack.
    from ninfer_plugins.protocols.openai_chat.completions_routes import completion_routes

    return completion_routes(state)
