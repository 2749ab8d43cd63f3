"""Text <-> token ids and the chat template, for a GGUF file or a Hugging Face directory.

Built on the `tokenizers` library and deliberately free of torch: the gateway tokenizes and
renders chat templates without loading any model code.

GGUF files carry no `tokenizer.json`, only llama.cpp's description of one (vocabulary, merges,
token types, a pre-tokenizer name). `from_gguf` rebuilds the tokenizer llama.cpp would run from
it, including the pre-tokenizer that name stands for: SmolLM2 ("smollm") splits every digit on
its own before the byte-level split, exactly as its original `tokenizer.json` does.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import processors

from splitserve.engine.chat_template import ChatTemplate
from splitserve.engine.gguf_file import GGUFSource, read_gguf
from splitserve.engine.gguf_metadata import GGUFMetadata
from splitserve.engine.tokenizer_gguf import adds_bos, gguf_backend


class Tokenizer:
    """Encodes, decodes and renders chat prompts; immutable after construction."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        # backend already applies BOS/EOS through its post-processor when the model wants them.
        self._backend = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._special_ids = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )
        self.chat_template = (
            ChatTemplate(chat_template, self._template_tokens()) if chat_template else None
        )
        self.eos_token_ids = self._collect_eos_ids(extra_eos_token_ids)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        return cls.from_gguf_reader(read_gguf(path))

    @classmethod
    def from_gguf_reader(cls, reader: GGUFSource) -> Tokenizer:
        """The tokenizer a GGUF file describes; the loader passes the reader it already opened."""
        meta = GGUFMetadata(reader)
        backend = gguf_backend(meta)
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        _set_post_processor(
            backend,
            bos_id if adds_bos(meta) else None,
            eos_id if meta.get("tokenizer.ggml.add_eos_token", False) else None,
        )
        return cls(
            backend,
            bos_token_id=_optional_int(bos_id),
            eos_token_id=_optional_int(eos_id),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` (transformers 5
        writes the template there) and `generation_config.json` (extra stop ids)."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"{os.fspath(path)!r} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        bos_id = _hf_token_id(backend, config.get("bos_token"))
        eos_id = _hf_token_id(backend, config.get("eos_token"))
        # An explicit add_bos/add_eos flag wins over tokenizer.json's post-processor, as in
        # transformers' Llama tokenizer; without one, tokenizer.json already says it all.
        if "add_bos_token" in config or "add_eos_token" in config:
            _set_post_processor(
                backend,
                bos_id if config.get("add_bos_token") else None,
                eos_id if config.get("add_eos_token") else None,
            )
        generation = _read_json(os.path.join(path, "generation_config.json"))
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            chat_template=_hf_chat_template(path, config),
            extra_eos_token_ids=_as_id_list(generation.get("eos_token_id")),
        )

    # ---- text <-> ids --------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text become single ids."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(self._checked_ids(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The whole tokenizer in `tokenizer.json` form (the grammar engine reads it)."""
        return self._backend.to_str()

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Vocabulary strings (byte-level spelling, e.g. "Ġthe") of one id or a list of ids."""
        if isinstance(ids, int):
            return _token_of(self._backend, self._checked_ids([ids])[0])
        return [_token_of(self._backend, token_id) for token_id in self._checked_ids(ids)]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._special_ids))

    # ---- chat ----------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for an OpenAI-style conversation ([{"role", "content"}, ...])."""
        if self.chat_template is None:
            raise ValueError("messages cannot be used: this model has no chat template")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    # ---- internals -----------------------------------------------------------------------

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        # The engine's own lists (plain ints, in range) pass in C-level min/max: the
        # detokenizer decodes twice per streamed token, so per-id checks added up at 64 streams.
        is_plain = type(ids) is list and ids and all(type(t) is int for t in ids)
        if is_plain and min(ids) >= 0 and max(ids) < self._vocab_size:
            return ids  # type: ignore[return-value]
        return [self._checked_id(token_id) for token_id in ids]

    def _checked_id(self, token_id: object) -> int:
        # operator.index accepts Python and NumPy integers but not floats or strings.
        try:
            value = operator.index(token_id)  # type: ignore[arg-type]
        except TypeError:
            value = -1
        if not 0 <= value < self._vocab_size:
            raise ValueError(f"ids must be ints in [0, {self._vocab_size}), got {token_id!r}")
        return value

    def _template_tokens(self) -> dict[str, str]:
        names = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        tokens = {
            name: self._backend.id_to_token(token_id)
            for name, token_id in names.items()
            if token_id is not None
        }
        # An id the vocabulary lacks leaves its name out of the template's variables.
        return {name: token for name, token in tokens.items() if token is not None}

    def _collect_eos_ids(self, extra_eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        candidates = [self.eos_token_id, self._end_of_turn_id(), *extra_eos_token_ids]
        unique = dict.fromkeys(token_id for token_id in candidates if token_id is not None)
        return tuple(unique)

    def _end_of_turn_id(self) -> int | None:
        """The special token the template writes right after an assistant reply.

        That is the token the model emits to end its turn (`<|im_end|>`, `<|eot_id|>`, ...), so
        generation must stop on it even when the file names a different EOS.
        """
        if self.chat_template is None:
            return None
        marker = "SplitserveReplyMarker"
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        try:
            text = self.chat_template.render(conversation, add_generation_prompt=False)
        except ValueError:
            return None  # a template that cannot express this conversation names no end token
        _, found, after = text.partition(marker)
        ids = self.encode(after.lstrip(), add_special_tokens=False) if found else []
        return ids[0] if ids and self.is_special(ids[0]) else None


def _set_post_processor(
    backend: tokenizers.Tokenizer, bos_id: int | None, eos_id: int | None
) -> None:
    """Makes `encode(add_special_tokens=True)` add BOS and/or EOS (or nothing)."""
    prefix = [_token_of(backend, bos_id)] if bos_id is not None else []
    suffix = [_token_of(backend, eos_id)] if eos_id is not None else []
    if not prefix and not suffix:
        backend.post_processor = None
        return
    backend.post_processor = processors.TemplateProcessing(
        single=[*prefix, "$A", *suffix],
        pair=[*prefix, "$A", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=[(token, backend.token_to_id(token)) for token in {*prefix, *suffix}],
    )


def _token_of(backend: tokenizers.Tokenizer, token_id: int) -> str:
    """The vocabulary string of `token_id`; ValueError for an id the vocabulary lacks (a
    file's BOS/EOS id past its vocabulary, or a hole in it)."""
    token = backend.id_to_token(token_id)
    if token is None:
        raise ValueError(f"token id {token_id} is not in the tokenizer's vocabulary")
    return token


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _hf_token_id(backend: tokenizers.Tokenizer, token: object) -> int | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _hf_chat_template(path: str | os.PathLike[str], config: Mapping[str, Any]) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        by_name = {entry.get("name"): entry.get("template") for entry in template}
        template = by_name.get("default")
    return template if isinstance(template, str) else None


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
