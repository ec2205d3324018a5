"""Caption -> fixed-length token ids, with nothing to download.

The default is byte-level UTF-8: ids 0-255 are the bytes, `PAD_ID` (256) fills the rest, so
the vocabulary is 257. A local `tokenizers` JSON file can replace it. Either way captions
are truncated to `length` tokens and right-padded with the tokenizer's pad id; the model
ignores pad positions in its text loss (see `pad_id`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.core.errors import UserError
from pipeline.core.files import sha256_file

PAD_ID = 256
PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>", "<|endoftext|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens: any caption in any language, no vocabulary file."""

    name = "bytes"
    vocab_size = 257
    pad_id = PAD_ID
    max_length = None  # captions take the model's text length

    def encode_batch(self, captions: list[str], length: int) -> np.ndarray:
        tokens = np.full((len(captions), length), self.pad_id, dtype=np.int64)
        for row, caption in enumerate(captions):
            encoded = np.frombuffer(caption.encode("utf-8")[:length], dtype=np.uint8)
            tokens[row, : len(encoded)] = encoded
        return tokens

    def unknown_words(self, text: str) -> list[str]:
        return []  # every text is bytes


class JsonTokenizer:
    """A Hugging Face `tokenizers` JSON file read from disk; its pad token pads."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("a tokenizer JSON needs the `tokenizers` package: pip install 'ttt[train]'") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable files
            raise UserError(f"cannot read tokenizer {path}: {err}") from None
        self.name = Path(path).name
        self.vocab_size = self.tokenizer.get_vocab_size()
        padding = self.tokenizer.padding
        pad_ids = [self.tokenizer.token_to_id(token) for token in PAD_TOKENS]
        pad_id = padding["pad_id"] if padding else next((i for i in pad_ids if i is not None), None)
        if pad_id is None:
            raise UserError(f"tokenizer {path} has no pad token (one of {', '.join(PAD_TOKENS)})")
        self.pad_id = int(pad_id)
        truncation = self.tokenizer.truncation  # a tokenizer that caps captions caps the model's text length
        self.max_length: int | None = truncation["max_length"] if truncation else None
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    def encode_batch(self, captions: list[str], length: int) -> np.ndarray:
        tokens = np.full((len(captions), length), self.pad_id, dtype=np.int64)
        for row, encoding in enumerate(self.tokenizer.encode_batch(captions, add_special_tokens=True)):
            ids = encoding.ids[:length]
            tokens[row, : len(ids)] = ids
        return tokens

    def unknown_words(self, text: str) -> list[str]:
        """The parts of `text` this tokenizer reads as its unknown token (a word-level vocabulary's missing words)."""
        unknown = getattr(self.tokenizer.model, "unk_token", None)
        unknown_id = self.tokenizer.token_to_id(unknown) if unknown else None
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        pieces = zip(encoding.ids, encoding.offsets, strict=True)
        return [text[start:end] for token, (start, end) in pieces if token == unknown_id]


def tokenizer_identity(path: str | Path | None) -> str:
    """What a tokenizer is, wherever its file lies: the byte tokenizer, or a hash of the tokenizers JSON."""
    if path is None:
        return "(UTF-8 bytes)"
    return f"(a tokenizers JSON, sha256 {sha256_file(path)[:12]})"


def load_tokenizer(path: str | Path | None = None) -> ByteTokenizer | JsonTokenizer:
    """The byte-level tokenizer, or the `tokenizers` JSON at `path`."""
    if path is None:
        return ByteTokenizer()
    if not Path(path).is_file():
        raise UserError(f"tokenizer file {path} does not exist")
    return JsonTokenizer(path)
