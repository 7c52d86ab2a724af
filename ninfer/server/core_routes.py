"""The server's own routes: readiness, the served model, and a root for probes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Optional

import msgspec
from litestar import Response, get, head
from litestar.params import Parameter

from ninfer import __version__
from ninfer.errors import NotFoundError
from ninfer.server.openapi import error_responses, json_response
from ninfer.server.retry_after import HEADER as RETRY_AFTER, retry_after

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

#: what /health answers while the engine cannot take work (also while the model loads)
HEALTH_UNAVAILABLE = {"status": "unavailable"}


class Health(msgspec.Struct):
    status: str


class ModelCard(msgspec.Struct):
    """OpenAI's model object plus the context length clients size requests by."""

    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "ninfer"
    #: a LoRA adapter's base model (vLLM's field); None for the base model itself
    parent: Optional[str] = None


class LegacyModel(msgspec.Struct):
    """The entry llama.cpp-style clients read from ``models``."""

    name: str
    model: str
    type: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    models: list[LegacyModel]
    object: str = "list"


class ServerInfo(msgspec.Struct):
    name: str
    version: str
    model: str


def core_routes(state: ServerState) -> list:
    created = int(time.time())
    cards = {state.model_id: ModelCard(id=state.model_id, created=created, max_model_len=state.max_model_len)}
    for name in state.loras:  # a request's model picks an adapter by name
        cards[name] = ModelCard(id=name, created=created, max_model_len=state.max_model_len, parent=state.model_id)
    listing = ModelList(data=list(cards.values()),
                        models=[LegacyModel(name=model_id, model=model_id) for model_id in cards])

    @get("/health", summary="Engine readiness", tags=["server"], sync_to_thread=False,
         responses={503: json_response(Health, "the engine cannot take work, or the server is shutting down")})
    def health() -> Response[Health]:
        if state.engine.alive and not state.gate.draining:
            return Response(Health("ok"))
        why = "engine_unavailable" if not state.engine.alive else "server_shutting_down"
        return Response(Health("unavailable"), status_code=503, headers={RETRY_AFTER: str(retry_after(503, why))})

    @get("/v1/models", summary="The served model", tags=["models"], sync_to_thread=False)
    def list_models() -> ModelList:
        return listing

    @get("/v1/models/{model_id:path}", summary="Look up the served model", tags=["models"], sync_to_thread=False,
         responses=error_responses(400, 404))
    def get_model(model_id: Annotated[str, Parameter(description="public model id")]) -> ModelCard:
        model_id = model_id.lstrip("/")  # a :path parameter keeps its leading slash
        if model_id not in cards:
            raise NotFoundError(f"the model {model_id!r} does not exist; this server serves "
                                f"{', '.join(map(repr, cards))}", param="model", code="model_not_found")
        return cards[model_id]

    @get("/", summary="Server name and version", tags=["server"], sync_to_thread=False)
    def root() -> ServerInfo:
        return ServerInfo(name="ninfer", version=__version__, model=state.model_id)

    @head("/", summary="Liveness probe", tags=["server"], sync_to_thread=False)
    def root_head() -> None:
        return None

    return [health, list_models, get_model, root, root_head]

