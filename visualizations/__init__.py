"""Pure views of run records: plotly figures, HTML strings and pandas DataFrames.

No model and no gradio here; every function takes records (engine.trace, engine.metrics, or the
serving records described in visualizations.timeline) and returns something to display.
"""

from visualizations.acceptance import (
    accepted_histogram,
    per_position_chart,
    theory_chart,
    theory_chart_for,
    tokens_vs_steps_chart,
    verify_curve_chart,
)
from visualizations.latency import itl_distribution_chart, itl_over_time_chart, serving_summary_table, ttft_chart
from visualizations.mtp_tree import mtp_tree_figure
from visualizations.timeline import (
    RequestTimes,
    ScheduledItem,
    ServingStep,
    TimelineAxes,
    serving_timeline,
    timeline_axes,
    trace_timeline,
)
from visualizations.tokens import TOKEN_CSS, legend_html, output_line_html, token_stream_html
from visualizations.verify import VerifyView, residual_chart, target_top_table, verify_table, verify_view

__all__ = [
    "TOKEN_CSS",
    "RequestTimes",
    "ScheduledItem",
    "ServingStep",
    "TimelineAxes",
    "VerifyView",
    "accepted_histogram",
    "itl_distribution_chart",
    "itl_over_time_chart",
    "legend_html",
    "mtp_tree_figure",
    "output_line_html",
    "per_position_chart",
    "residual_chart",
    "serving_summary_table",
    "serving_timeline",
    "target_top_table",
    "theory_chart",
    "theory_chart_for",
    "timeline_axes",
    "token_stream_html",
    "tokens_vs_steps_chart",
    "trace_timeline",
    "ttft_chart",
    "verify_curve_chart",
    "verify_table",
    "verify_view",
]
