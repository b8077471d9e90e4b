"""Speculative Decoding Lab engine: models, drafters, acceptance math, decoding loop, metrics.

No UI imports live here (no gradio, no plotly): the app, the CLI and the benchmarks all read
the typed records this package yields.
"""
