"""The ground: what every layer of headfold shares, importing nothing of headfold itself.

errors (the ways headfold stops early), atomic (the one output policy: outputs whole, together,
never through a link or over an input), inputs (the one input policy: inside the folder given,
bounded JSON/YAML readers, escaped echo), hashing (file digests, the versions a file records),
artifacts (the names of the files headfold writes, and the mark that says headfold wrote one),
lazy (heavy modules imported on first use and held to pyproject's version ranges), precision (the one
precision vocabulary: fp32, fp16, bf16, int4), settings (the stages' settings objects the CLI builds
and the API takes, each default declared once).
"""

VERSION = "0.1.0"  # headfold's own version: `headfold.__version__`, stamped into sidecars and stage keys
