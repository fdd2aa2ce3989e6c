"""Benchmark harness: ``python -m flashgdn.bench --help``.

Runs flashgdn and the anchors (FlashQLA, FLA in pure Triton, FlashInfer) side by side on the same inputs,
checks each against the float64 reference before timing it, and writes a JSON file (schema in
``flashgdn.bench.results``), a Markdown table and PNG plots.
"""
