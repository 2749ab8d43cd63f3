"""The base of every request model: strict types (`"max_tokens": "10"` is refused, not coerced)
and closed (a field not declared is refused), so each bad body is one 400 naming its field
(`errors.from_validation`). Aliases are accepted by field name too (`schema_` for "schema")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
