"""`python -m headfold`: the same as the `headfold` command."""

import sys

from headfold.cli import main

sys.exit(main())
