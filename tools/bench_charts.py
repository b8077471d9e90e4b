"""Draw a benchmark's charts: `python tools/bench_charts.py DIR` reads DIR/bench.json (written by
`python -m engine bench --out DIR`) and writes DIR/charts.html (every chart on one page that works
offline: plotly's script is embedded once) and, where kaleido is installed, one PNG per chart."""

from __future__ import annotations

import html
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from visualizations.bench import bench_charts  # noqa: E402


def write_charts(folder: Path) -> list[Path]:
    report = json.loads((folder / "bench.json").read_text(encoding="utf-8"))
    charts = bench_charts(report)
    parts = [figure.to_html(full_html=False, include_plotlyjs=i == 0) for i, figure in enumerate(charts.values())]
    page = folder / "charts.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(report['command'])}</title>"
                    f"</head><body>{''.join(parts)}</body></html>", encoding="utf-8")
    written = [page]
    if importlib.util.find_spec("kaleido") is not None:
        for name, figure in charts.items():
            figure.write_image(folder / f"{name}.png")
            written.append(folder / f"{name}.png")
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "bench.json").is_file():
        sys.exit("usage: python tools/bench_charts.py DIR  (DIR holds bench.json from `python -m engine bench --out DIR`)")
    print("wrote " + ", ".join(str(p) for p in write_charts(Path(sys.argv[1]))))
