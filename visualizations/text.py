"""Token text made visible and safe: whitespace markers, escaping for HTML and plotly, and
characters a byte-level tokenizer split over several tokens put back together.

Token text comes from a model (or an uploaded trace), so it is untrusted: every token placed in
HTML goes through `html_token`, every token placed in a plotly label through `plotly_text`.
"""

from __future__ import annotations

import codecs
import html
from collections.abc import Collection, Sequence
from dataclasses import dataclass

WHITESPACE_MARKERS = {" ": "␣", "\t": "⇥", "\r": "␍", "\n": "↵"}
_MARK = str.maketrans(WHITESPACE_MARKERS)


def show_whitespace(text: str) -> str:
    """Plain text with spaces, tabs and newlines replaced by visible markers.

    >>> show_whitespace(" the\\n")
    '␣the↵'
    """
    return text.translate(_MARK)


def html_token(text: str, line_breaks: bool = True) -> str:
    """Escaped HTML for a token: whitespace markers, and a real line break after each newline
    (without `line_breaks`, for drafts that are not part of the output, the marker alone).

    >>> html_token("<script>alert(1)</script>")
    '&lt;script&gt;alert(1)&lt;/script&gt;'
    >>> html_token(" a\\n"), html_token(" a\\n", line_breaks=False)
    ('␣a↵<br>', '␣a↵')
    """
    newline = "↵<br>" if line_breaks else "↵"
    return newline.join(html.escape(show_whitespace(part)) for part in text.split("\n"))


@dataclass(frozen=True)
class ByteRun:
    """Consecutive tokens [start, end) shown as one: `text` is the characters their bytes
    complete, `dangling` the bytes of theirs still waiting for the rest of a character."""

    start: int
    end: int
    text: str
    dangling: bytes = b""
    carried: bytes = b""  # bytes an earlier run left waiting, which this one completes


def byte_runs(pieces: Sequence[bytes | None], cuts: Collection[int] = ()) -> list[ByteRun]:
    """Group tokens so that each group shows whole characters: a token whose bytes stop part-way
    through a UTF-8 character runs on into the next. pieces[i] is token i's bytes (None: a special
    token, outside the text, always alone); a run also ends before each index in `cuts` (a step
    boundary), and the bytes it leaves waiting are its `dangling` (the next run completes them).

    >>> [(r.start, r.end, r.text) for r in byte_runs([b"a", b"\\xe6\\x97", b"\\xa5", b"\\xe6\\x9c\\xac"])]
    [(0, 1, 'a'), (1, 3, '日'), (3, 4, '本')]
    >>> [(r.text, r.dangling, r.carried) for r in byte_runs([b"\\xf0\\x9f", b"\\x98\\x80"], cuts={1})]
    [('', b'\\xf0\\x9f', b''), ('😀', b'', b'\\xf0\\x9f')]
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    runs: list[ByteRun] = []
    start, text, fed, carried = 0, "", 0, b""  # the open run: first token, characters, bytes fed and carried in

    def close(end: int) -> None:
        waiting = decoder.getstate()[0]
        runs.append(ByteRun(start, end, text, waiting[max(0, len(waiting) - fed):], carried))

    for i, piece in enumerate(pieces):
        if i > start and (piece is None or pieces[i - 1] is None or i in cuts or not decoder.getstate()[0]):
            close(i)
            start, text, fed, carried = i, "", 0, b"" if piece is None else decoder.getstate()[0]
        if piece is not None:
            text += decoder.decode(piece)
            fed += len(piece)
    if pieces:
        close(len(pieces))
    return runs


def piece_parts(raw: bytes) -> tuple[bytes, str, bytes]:
    """One token's bytes seen alone: the end of a character begun before it, the whole
    characters, and the start of one it leaves unfinished (for a draft, which has no neighbours
    to merge with).

    >>> piece_parts(b" \\xf0\\x9f"), piece_parts(b"\\x98\\x80!")
    ((b'', ' ', b'\\xf0\\x9f'), (b'\\x98\\x80', '!', b''))
    """
    head = 0
    while head < min(3, len(raw)) and 0x80 <= raw[head] < 0xC0:  # continuation bytes: at most 3 end a character
        head += 1
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(raw[head:])
    return raw[:head], text, decoder.getstate()[0]


def plotly_text(text: str) -> str:
    """A token as plotly label text. Plotly reads a few HTML tags (<b>, <br>, ...) and decodes
    &lt; &gt; &amp;, so escaping those three shows the token literally; quotes need no escape.

    >>> plotly_text("<b> & x")
    '&lt;b&gt;␣&amp;␣x'
    """
    return html.escape(show_whitespace(text), quote=False)


def plotly_label(text: str) -> str:
    """A name (request id, setting, class) as plotly label text: escaped, spaces kept.

    >>> plotly_label("<i>r1</i> long")
    '&lt;i&gt;r1&lt;/i&gt; long'
    """
    return html.escape(text, quote=False)
