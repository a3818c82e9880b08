"""The benchmarks: each module measures speed, memory or quality, prints a table and writes its
figures to benchmarks/results/*.json, from which `python -m benchmarks.render` generates the pages.
Run them from the repository root as modules (`python -m benchmarks.NAME --help`)."""
