"""Files a benchmark writes to --out: the JSON object, the markdown tables and the charts.

The charts are plotly figures built by visualizations.bench (pure functions of the JSON
object); this package itself holds no plotting code, and plotly is imported only here, when
files are written. PNG copies need kaleido, which is optional (not in requirements.txt).
"""

from __future__ import annotations

import html
import importlib.util
import json
from pathlib import Path

from engine.errors import InputError


def png_available() -> bool:
    return importlib.util.find_spec("kaleido") is not None


def write_bench(report: dict, markdown_text: str, out: str) -> list[Path]:
    """Write bench.json, bench.md, charts.html (every chart in one page that works offline: plotly's
    script is embedded once) and, with kaleido, one PNG per chart."""
    from visualizations.bench import bench_charts

    folder = _folder(out)
    written = [folder / "bench.json", folder / "bench.md"]
    written[0].write_text(json.dumps(report, ensure_ascii=False, allow_nan=False, indent=1), encoding="utf-8")
    written[1].write_text(markdown_text, encoding="utf-8")
    charts = bench_charts(report)
    parts = [figure.to_html(full_html=False, include_plotlyjs=i == 0) for i, figure in enumerate(charts.values())]
    page = folder / "charts.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(report['command'])}</title>"
                    f"</head><body>{''.join(parts)}</body></html>", encoding="utf-8")
    written.append(page)
    if png_available():
        for name, figure in charts.items():
            figure.write_image(folder / f"{name}.png")
            written.append(folder / f"{name}.png")
    return written


def _folder(out: str) -> Path:
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot create output folder {out!r}: {err.__class__.__name__}") from None
    return folder
