"""Content-Disposition: reading a multipart part's field name and file name, writing a download's.

python-multipart decodes header parameters as Latin-1 and drops the RFC 2231 / RFC 5987
extended form (`filename*=UTF-8''…`), so a name like `测试文件.txt` broke uploads. This parser
takes both forms, as Go's `mime.ParseMediaType` (what upstream envd uses) does: raw UTF-8 in a
quoted `filename="…"` (what httpx and browsers send), `filename*=charset'lang'%XX…`, and
`filename*0*=…; filename*1=…` continuations. An extended value wins over the plain one.

Bytes that are not UTF-8 are kept with `surrogateescape`, so the file is created under exactly
the bytes the client sent; `entries.printable` turns such a name into text for JSON answers.
"""

from __future__ import annotations

import codecs
import re
import urllib.parse

_SEPARATORS = frozenset('()<>@,;:\\"/[]?= \t')
# RFC 2231 "attribute-char": a token character other than `*`, `'` and `%`.
_ATTRIBUTE_CHARS = frozenset(
    chr(c) for c in range(0x21, 0x7F) if chr(c) not in _SEPARATORS and chr(c) not in "*'%"
)
_PIECE = re.compile(r"^(?P<base>[^*]+)\*(?P<index>\d+)(?P<encoded>\*?)$")


def _split(text: str) -> list[tuple[str, str]]:
    """`key=value` pairs after the disposition type, quoted strings unescaped."""
    pairs: list[tuple[str, str]] = []
    pos = text.find(";")
    if pos < 0:
        return pairs
    pos += 1
    while pos < len(text):
        while pos < len(text) and text[pos] in "; \t":
            pos += 1
        equals = text.find("=", pos)
        semicolon = text.find(";", pos)
        if equals < 0 or (0 <= semicolon < equals):
            # A parameter without a value: nothing to take from it.
            pos = len(text) if semicolon < 0 else semicolon + 1
            continue
        key = text[pos:equals].strip().lower()
        pos = equals + 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and text[pos] == '"':
            value, pos = _quoted(text, pos + 1)
        else:
            end = text.find(";", pos)
            end = len(text) if end < 0 else end
            value, pos = text[pos:end].strip(), end
        if key:
            pairs.append((key, value))
    return pairs


def _quoted(text: str, pos: int) -> tuple[str, int]:
    """A quoted string's content from just after its opening quote; `\\x` stands for `x`."""
    out: list[str] = []
    while pos < len(text):
        char = text[pos]
        if char == "\\" and pos + 1 < len(text):
            out.append(text[pos + 1])
            pos += 2
            continue
        if char == '"':
            return "".join(out), pos + 1
        out.append(char)
        pos += 1
    return "".join(out), pos  # unterminated: take what there is, as lenient parsers do


def _unquote(value: str, charset: str) -> str | None:
    raw = urllib.parse.unquote_to_bytes(value)
    try:
        codec = codecs.lookup(charset).name
    except LookupError:
        return None  # an unknown charset: the plain parameter, if any, stands
    if codec in ("utf-8", "ascii"):
        return raw.decode("utf-8", "surrogateescape")
    try:
        return raw.decode(codec)
    except UnicodeDecodeError:
        return None


def _extended(value: str) -> str | None:
    """An RFC 2231 `charset'language'%XX…` value, or None when it cannot be decoded."""
    parts = value.split("'", 2)
    if len(parts) != 3:
        return None
    return _unquote(parts[2], parts[0] or "us-ascii")


def params(raw: bytes) -> dict[str, str]:
    """The parameters of a Content-Disposition header value, keys lowercased."""
    text = raw.decode("utf-8", "surrogateescape")
    plain: dict[str, str] = {}
    starred: dict[str, str] = {}
    pieces: dict[str, dict[int, tuple[str, bool]]] = {}
    for key, value in _split(text):
        piece = _PIECE.match(key)
        if piece:
            pieces.setdefault(piece["base"], {})[int(piece["index"])] = (
                value,
                bool(piece["encoded"]),
            )
        elif key.endswith("*"):
            starred.setdefault(key[:-1], value)
        else:
            plain.setdefault(key, value)
    result = dict(plain)
    for base, numbered in pieces.items():
        joined = _join_pieces(numbered)
        if joined is not None:
            result[base] = joined
    for base, value in starred.items():
        decoded = _extended(value)
        if decoded is not None:
            result[base] = decoded
    return result


def _join_pieces(numbered: dict[int, tuple[str, bool]]) -> str | None:
    """`name*0`, `name*1*`, … in order, up to the first gap; the charset is the first piece's."""
    out: list[str] = []
    charset = "us-ascii"
    index = 0
    while index in numbered:
        value, encoded = numbered[index]
        if encoded and index == 0:
            parts = value.split("'", 2)
            if len(parts) != 3:
                return None
            charset, value = parts[0] or "us-ascii", parts[2]
        if encoded:
            decoded = _unquote(value, charset)
            if decoded is None:
                return None
            value = decoded
        out.append(value)
        index += 1
    return "".join(out) if out else None


def inline(filename: str) -> str:
    """A download's `Content-Disposition`: `inline` and the file's name.

    A plain ASCII name goes as it is (quoted if it needs to be); anything else in the RFC 5987
    form `filename*=utf-8''%XX…`, which HTTP headers can carry and browsers understand.
    """
    if filename and all(char in _ATTRIBUTE_CHARS for char in filename):
        return f"inline; filename={filename}"
    if all(" " <= char <= "~" for char in filename):
        escaped = filename.replace("\\", "\\\\").replace('"', '\\"')
        return f'inline; filename="{escaped}"'
    encoded = "".join(
        chr(byte) if chr(byte) in _ATTRIBUTE_CHARS else f"%{byte:02X}"
        for byte in filename.encode("utf-8", "surrogateescape")
    )
    return f"inline; filename*=utf-8''{encoded}"
