"""GET /v1/models and /v1/models/{id}: the model this gateway serves, with the context length
its decode pods report, and each LoRA adapter the pods hold, with the base model as `parent`
(as vLLM lists them)."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from splitserve.gateway.core import GatewayCore
from splitserve.gateway.errors import error_body


class ModelRoutes:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.created = int(time.time())

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])

    async def models(self) -> dict:
        return {"object": "list", "data": self._cards()}

    async def model(self, model_id: str) -> JSONResponse:
        card = next((card for card in self._cards() if card["id"] == model_id), None)
        if card is None:
            message = f"The model {model_id!r} does not exist; this server serves " + repr(
                self.core.model_name
            )
            body = error_body(message, "invalid_request_error", "model", "model_not_found")
            return JSONResponse(body, status_code=404)
        return JSONResponse(card)

    def _cards(self) -> list[dict]:
        base = self._card(self.core.model_name)
        base["parent"] = None
        adapters = sorted(self.core.served_models().adapters)
        return [base, *(self._card(name, parent=self.core.model_name) for name in adapters)]

    def _card(self, model_id: str, parent: str | None = None) -> dict:
        card: dict = {
            "id": model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
            "root": model_id,
        }
        if parent is not None:
            card["parent"] = parent
        max_model_len = self.core.decode_pool.max_model_len
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return card
