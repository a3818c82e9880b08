"""Heavy modules a command loads only when it uses them, in the manner of Polygraphy's
``mod.lazy_import``: ``trt = lazy_import("tensorrt")`` at the top of a module costs nothing; the
first attribute read imports the module and holds it to the range headfold pins. A missing or
too-old module is BadInput (exit 2): one line naming the ``pip install`` that fixes it.

The ranges are pyproject's: the installed package's requirements (dependencies and extras), read
once, so a pin is declared in one place.
"""

from __future__ import annotations

import functools
import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from headfold.ground.errors import BadInput, first_line

if TYPE_CHECKING:
    from packaging.requirements import Requirement

DISTRIBUTIONS = {"yaml": "pyyaml"}  # a module whose distribution is not its name (as canonicalize_name spells it)


@functools.cache
def requirement(module: str) -> Requirement:
    """What headfold requires of the distribution that provides `module` (its top-level name): its
    pinned range, e.g. ``tensorrt>=10.13`` from the ``trt`` extra, or the bare name where none is pinned."""
    import importlib.metadata  # with packaging, slow to import: paid when a module loads, not by every holder of a handle

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    distribution = canonicalize_name(DISTRIBUTIONS.get(module, module))
    try:
        declared = importlib.metadata.requires("headfold") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        declared = []
    for line in declared:
        required = Requirement(line)
        if canonicalize_name(required.name) == distribution:
            required.marker = None  # `extra == "trt"`: the range is the point, not the extra that brings it
            return required
    return Requirement(distribution)


def load(name: str) -> ModuleType:
    """Import `name` now; BadInput with the pip command when it is missing or outside the pinned range."""
    top = name.partition(".")[0]
    required = requirement(top)
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise BadInput(f"{top} cannot be imported ({first_line(err)}); pip install '{required}'") from None
    version = getattr(sys.modules[top], "__version__", None)
    if isinstance(version, str) and not required.specifier.contains(version, prereleases=True):
        raise BadInput(f"{top} {version} is installed, headfold needs {required.specifier}; pip install '{required}'")
    return module


class LazyModule:
    """A module imported (and its version checked) on first attribute access."""

    def __init__(self, name: str) -> None:
        self.__dict__.update(_name=name, _module=None)

    def __getattr__(self, attribute: str) -> Any:
        if self._module is None:
            self.__dict__["_module"] = load(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        return f"<lazily imported module {self._name!r}>"


def lazy_import(name: str) -> Any:
    """`name` (a module, dotted for a submodule), imported by `load` when first used."""
    return LazyModule(name)
