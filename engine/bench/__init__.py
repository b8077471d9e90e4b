"""Benchmarks and the quality gate: `python -m engine bench` and `python -m engine gate`.

prompts.py (prompt sets as data) -> methods.py (what runs) -> runner.py (interleaved timed runs,
hf.py for transformers' generate()) -> report.py (JSON and markdown, metrics from engine.metrics)
-> output.py (files); gate.py checks that a method leaves the target's output unchanged.
"""
