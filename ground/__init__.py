"""The ground: what every layer of headfold shares, importing nothing of headfold itself.

errors (the ways headfold stops early), atomic (outputs whole or not at all), hashing (file
digests, the versions a file records), artifacts (the names of the files headfold writes).
"""

VERSION = "0.1.0"  # headfold's own version: `headfold.__version__`, stamped into sidecars and stage keys
