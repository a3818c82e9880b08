"""local's fit against the fit it replaced, on trained models: held-out KL, perplexity and convert CPU seconds.

Each model (--models, as benchmarks/method_parts.py names them) is converted with the default method at
kv = h/4 (--kv) for each --calibration-tokens count (--tokens) and each fit (--fits):

- `previous`: every calibration window fitted at every step at a constant rate, nothing held out, the kept
  iterate the best on the fitted windows (the fit before held-out selection);
- `default`: today's (converter/local.py: a seeded quarter of the windows held out to pick the kept iterate
  and stop early, minibatches of windows, a cosine rate).

The fits differ only in local's module constants, set here for each row. KL(original ‖ converted) per token,
perplexity and top-1 on the model's held-out windows (method_parts.py's scoring). Writes JSON (default
benchmarks/results/local_fit.json), rows added to those of earlier runs (--fresh starts over).

    python -m benchmarks.local_fit [--models embedded] [--tokens 4096,16384] [--fits previous,default,FREE=maps+PATIENCE=10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

from benchmarks import method_parts
from headfold.converter.recipes import DEFAULT_LOCAL_STEPS, DEFAULT_METHOD
from headfold.ground.settings import LocalFit

FITS = {
    "previous": {"validation": 0.0, "batch": 10**9, "floor": 1.0, "every": 1, "patience": 10**9},
    "default": {},
    "all": {"free": "all"},
    "maps": {"free": "maps"},
}
TUNABLES = ("validation", "batch", "floor", "every", "patience", "free", "determined")  # the LocalFit fields each row records
DEFAULT_JSON = Path(__file__).parent / "results" / "local_fit.json"
WHAT = (
    "local's fit before held-out selection (`previous`: every window at every step, constant rate, best on the fitted windows) "
    "against today's (`default`), with the default method at h/4, on trained models at several calibration-token counts: "
    "KL(original ‖ converted), perplexity and top-1 on each model's held-out windows, convert CPU seconds on a shared 2-core machine"
)


def settings(fit: str) -> LocalFit:
    """A fit's settings: a name in FITS, or assignments joined by '+' (free=maps+patience=10), typed as LocalFit's fields."""
    if fit in FITS:
        return LocalFit(**FITS[fit])
    pairs = [part.split("=", 1) for part in fit.split("+")]
    return LocalFit(**{name.lower(): type(getattr(LocalFit, name.lower()))(value) for name, value in pairs})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="embedded")
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--fits", default="previous,default")
    parser.add_argument("--kv", default="h/4")
    parser.add_argument("--steps", type=int, default=DEFAULT_LOCAL_STEPS)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        model = method_parts.model(name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for fit in args.fits.split(","):
                chosen = settings(fit)
                with tempfile.TemporaryDirectory() as tmp:
                    for row in method_parts.rows_for(model, [DEFAULT_METHOD], args.kv, args.steps, Path(tmp), tokens, chosen):
                        rows.append({**row, "fit": fit, "calibration_tokens": tokens, **{name: getattr(chosen, name) for name in TUNABLES}})
    old = [] if args.fresh or not args.json.exists() else json.loads(args.json.read_text())["rows"]  # read last: runs beside this one merge
    key = lambda r: (r["model"], r["kv_heads"], r["calibration_tokens"], r["fit"], r["local_steps"])  # noqa: E731
    kept = [r for r in old if key(r) not in {key(n) for n in rows}]
    args.json.write_text(json.dumps({"what": WHAT, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "rows": kept + rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
