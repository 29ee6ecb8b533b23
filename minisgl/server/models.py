"""The names a server answers to (`--served-model-name`): /v1/models, /v1/models/{id} and the
check of every request's `model`.

A request naming a model this server does not serve gets OpenAI's 404 `model_not_found`, as
vLLM answers. A request without `model`, and one naming `default`, take the first served name:
`default` stays an alias so that clients written for the server's earlier answers keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from minisgl.server.errors import ApiError

DEFAULT_ALIAS = "default"


@dataclass(frozen=True)
class ServedModels:
    names: tuple[str, ...]  # the first is the id of answers to requests that name none
    max_context: int
    created: int

    def check(self, requested: str | None) -> str:
        """The name an answer carries: the one asked for, or the first served name for none
        and `default`. Any other name raises the 404 `model_not_found`."""
        if requested in self.names:
            assert requested is not None
            return requested
        if requested is None or requested == DEFAULT_ALIAS:
            return self.names[0]
        raise ApiError(
            404,
            f"The model `{requested}` does not exist; this server serves "
            f"{', '.join(repr(n) for n in self.names)} (`{DEFAULT_ALIAS}` names the first)",
            "model",
            code="model_not_found",
        )

    def card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "minisgl",
            "max_model_len": self.max_context,
        }

    def list_models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self.card(n) for n in self.names]})

    def retrieve(self, model_id: str) -> JSONResponse:
        return JSONResponse(self.card(self.check(model_id)))


def add_model_routes(
    add_get: Callable[..., None], served: ServedModels, list_doc: Any, card_doc: Any
) -> None:
    """`add_get(path, endpoint, responses=...)` adds a GET route (with its HEAD twin)."""

    async def models() -> JSONResponse:
        return served.list_models()

    async def model_card(model_id: str) -> JSONResponse:
        """One model (the SDK's `models.retrieve`); ids may hold slashes."""
        return served.retrieve(model_id)

    add_get("/v1/models", models, responses=list_doc)
    add_get("/v1/models/{model_id:path}", model_card, responses=card_doc)
