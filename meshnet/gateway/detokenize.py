"""Token ids → text as they arrive, and the text and bytes of single tokens (for logprobs).

:class:`TextDecoder` decodes incrementally: each new token re-decodes only a short window of
recent ids, so a generation of ``n`` tokens costs O(n) decoding instead of the O(n²) of
decoding everything again at every step.
"""

from __future__ import annotations

import weakref

# per-tokenizer facts, computed once (weak keys: a dropped shard's tokenizer is not kept alive)
_BYTE_LEVEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TextDecoder:
    """The text of the ids added so far (``skip_special_tokens=True``), grown token by token.

    The window ``ids[prefix:]`` is decoded and compared with the decoding of
    ``ids[prefix:read]`` (text already emitted); the difference is new text. While the
    window ends inside a multi-byte character (decodes to a trailing U+FFFD) nothing is
    emitted, so characters split across tokens come out whole. The window's left edge stays
    one step behind, which keeps tokenizers that strip a leading space on the first token of
    a decode from losing it.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start (index into ids)
        self._read = 0    # ids before this index have their text in ``self.text``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; returns the whole text so far (complete characters only)."""
        self.ids.append(token_id)
        done = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(done) and not window.endswith("\ufffd"):
            self.text += window[len(done):]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text

    def flush(self) -> str:
        """The whole text, including a trailing incomplete character (as U+FFFD)."""
        done = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(done):
            self.text += window[len(done):]
        self._prefix = self._read = len(self.ids)
        return self.text


def _printable_bytes() -> dict[str, int]:
    """Byte-level BPE's alphabet: every byte value is written as one printable character
    (printable Latin-1 bytes as themselves, the other 68 as U+0100 onwards, in byte order).
    Returns character → byte."""
    same = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in same}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


_PRINTABLE = _printable_bytes()


def _is_byte_level(tokenizer) -> bool:
    cached = _BYTE_LEVEL.get(tokenizer)
    if cached is None:
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        cached = "ByteLevel" in type(getattr(backend, "decoder", None)).__name__
        _BYTE_LEVEL[tokenizer] = cached
    return cached


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token (special tokens included; a partial UTF-8 character is U+FFFD)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """The UTF-8 bytes one token stands for, as OpenAI's ``logprobs`` ``bytes`` (ints 0..255).

    Byte-level BPE tokens give their exact bytes, also when they hold only part of a
    character; other tokens (added and special tokens, other tokenizer kinds) the UTF-8 of
    their text.
    """
    if token_id not in getattr(tokenizer, "added_tokens_decoder", {}) and _is_byte_level(tokenizer):
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in _PRINTABLE for c in piece):
            return [_PRINTABLE[c] for c in piece]
    return list(token_text(tokenizer, token_id).encode("utf-8"))


def max_token_chars(tokenizer) -> int:
    """The most characters any single token can stand for (cached per tokenizer): the
    longest vocabulary entry. A text of ``c`` characters is at least ``ceil(c / this)``
    tokens, a bound that needs no tokenization."""
    if tokenizer not in _MAX_CHARS:
        _MAX_CHARS[tokenizer] = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    return _MAX_CHARS[tokenizer]
