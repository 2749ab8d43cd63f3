"""vLLM's /tokenize and /detokenize: the gateway's own tokenizer and chat template, the very
calls a generation request's prompt goes through (so a count here is that request's
prompt_tokens). No pod is asked, except for the context length they serve."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import Field

from splitserve.gateway.api.chat import ChatMessage, chat_messages
from splitserve.gateway.api.respond import encode_conversation
from splitserve.gateway.core import GatewayCore
from splitserve.gateway.errors import RequestError
from splitserve.gateway.strict_model import StrictModel


class TokenizeBody(StrictModel):
    """Either `prompt` (a completion's prompt) or `messages` (a chat's conversation)."""

    model: str | None = Field(None, description="The served model's id; may be left out.")
    prompt: str | None = Field(None, description="A text, tokenized as /v1/completions does.")
    messages: list[ChatMessage] | None = Field(
        None, description="A conversation, rendered and tokenized as /v1/chat/completions does."
    )
    add_special_tokens: bool | None = Field(
        None, description="With prompt: add the model's BOS/EOS (default true)."
    )
    add_generation_prompt: bool | None = Field(
        None, description="With messages: end with the assistant's header (default true)."
    )
    return_token_strs: bool | None = Field(
        None, description="Also return each token's vocabulary string."
    )


class DetokenizeBody(StrictModel):
    model: str | None = Field(None, description="The served model's id; may be left out.")
    tokens: list[int] = Field(description="Token ids to turn back into text.")


class TokenRoutes:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def tokenize(self, body: TokenizeBody) -> dict:
        self._check_model(body.model)
        tokens = self._tokens(body)
        answer: dict = {
            "count": len(tokens),
            "max_model_len": self.core.max_model_len,
            "tokens": tokens,
        }
        if body.return_token_strs:
            answer["token_strs"] = self.core.tokenizer.convert_ids_to_tokens(tokens)
        return answer

    async def detokenize(self, body: DetokenizeBody) -> dict:
        self._check_model(body.model)
        try:
            return {"prompt": self.core.tokenizer.decode(body.tokens)}
        except ValueError as error:  # an id outside the vocabulary
            raise RequestError(f"tokens: {error}", "tokens") from None

    def _tokens(self, body: TokenizeBody) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise RequestError(
                "prompt (or messages): exactly one of the two must be given", "prompt"
            )
        if body.prompt is not None:
            if body.add_generation_prompt is not None:
                raise RequestError(
                    "add_generation_prompt applies to messages only", "add_generation_prompt"
                )
            return self.core.encode(body.prompt, body.add_special_tokens is not False)
        if body.add_special_tokens is not None:
            raise RequestError("add_special_tokens applies to prompt only", "add_special_tokens")
        messages = chat_messages(body.messages or [])
        return encode_conversation(
            self.core, messages, "messages", body.add_generation_prompt is not False
        )

    def _check_model(self, model: str | None) -> None:
        """The base model or an adapter (adapters share its tokenizer); else a 404."""
        self.core.served_models().lora_name(model)
