"""GET /v1/models and /v1/models/{id}: the one model this gateway serves, with the context
length its decode pods report."""

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
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.core.model_name:
            message = f"The model {model_id!r} does not exist; this server serves " + repr(
                self.core.model_name
            )
            body = error_body(message, "invalid_request_error", "model", "model_not_found")
            return JSONResponse(body, status_code=404)
        return JSONResponse(self._card())

    def _card(self) -> dict:
        card = {
            "id": self.core.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
        }
        max_model_len = self.core.decode_pool.max_model_len
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return card
