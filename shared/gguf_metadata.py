"""A GGUF file's metadata, read by key: the one reader the tokenizer and the model loader share.

Torch-free, as the tokenizer is: the gateway builds a GGUF file's tokenizer without model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.engine.gguf_file import GGUFSource


class GGUFMetadata:
    """Typed access to an open GGUF file's metadata fields (gguf_file.py; it opens nothing
    itself, so the loader and the tokenizer share the file the loader opened)."""

    def __init__(self, reader: GGUFSource) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        """The field's value; ValueError naming the key when the file lacks it."""
        field = self._fields.get(key)
        if field is None:
            raise ValueError(f"GGUF file lacks required metadata {key!r}")
        return field.contents()
