"""Token text made visible and safe: whitespace markers, and escaping for HTML and plotly.

Token text comes from a model (or an uploaded trace), so it is untrusted: every token placed in
HTML goes through `html_token`, every token placed in a plotly label through `plotly_text`.
"""

from __future__ import annotations

import html

WHITESPACE_MARKERS = {" ": "␣", "\t": "⇥", "\r": "␍", "\n": "↵"}
_MARK = str.maketrans(WHITESPACE_MARKERS)


def show_whitespace(text: str) -> str:
    """Plain text with spaces, tabs and newlines replaced by visible markers.

    >>> show_whitespace(" the\\n")
    '␣the↵'
    """
    return text.translate(_MARK)


def html_token(text: str) -> str:
    """Escaped HTML for a token: whitespace markers, and a real line break after each newline.

    >>> html_token("<script>alert(1)</script>")
    '&lt;script&gt;alert(1)&lt;/script&gt;'
    >>> html_token(" a\\n")
    '␣a↵<br>'
    """
    return "↵<br>".join(html.escape(show_whitespace(part)) for part in text.split("\n"))


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
