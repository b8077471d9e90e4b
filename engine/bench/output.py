"""Files a benchmark writes to --out: the JSON object and the markdown tables.

Charts are drawn from bench.json by `python tools/bench_charts.py DIR` (plotly lives in
visualizations/, which engine/ never imports).
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.errors import InputError


def write_bench(report: dict, markdown_text: str, out: str) -> list[Path]:
    """Write bench.json and bench.md into the folder `out` (created if needed)."""
    folder = _folder(out)
    written = [folder / "bench.json", folder / "bench.md"]
    written[0].write_text(json.dumps(report, ensure_ascii=False, allow_nan=False, indent=1), encoding="utf-8")
    written[1].write_text(markdown_text, encoding="utf-8")
    return written


def _folder(out: str) -> Path:
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot create output folder {out!r}: {err.__class__.__name__}") from None
    return folder
