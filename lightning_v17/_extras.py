"""The optional backends (deepspeed, bitsandbytes, torchao) and the pyproject extras that install them.

They are not dependencies of lightning-v17: installing it must leave a user's environment, torch included, as it
was, and most runs use none of them. Each is imported only where its feature runs, through :func:`require`, so a
missing one fails at that feature with the extra to install instead of at ``import lightning_v17``. Torch-free.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require", "require_installed"]

#: top-level import name -> the extra of ``pyproject.toml`` that installs it
EXTRAS: dict[str, str] = {"deepspeed": "deepspeed", "bitsandbytes": "bnb", "torchao": "torchao"}


class MissingExtraError(ModuleNotFoundError):
    """A feature's optional backend is not installed; the message names the feature and the extra that installs it."""


def _missing(package: str, feature: str) -> MissingExtraError:
    return MissingExtraError(
        f"{feature} needs {package}, which is not installed; install it with pip install "
        f"'lightning-v17[{EXTRAS[package]}]' (or 'lightning-v17[all]' for deepspeed, bitsandbytes and torchao)",
        name=package,
    )


def require_installed(package: str, *, feature: str) -> None:
    """Check that ``package`` (a key of :data:`EXTRAS`) can be imported, without importing it (torchao and
    bitsandbytes take seconds), so that a configuration fails when it is made rather than at set-up.

    Raises:
        MissingExtraError: it is not installed.
    """
    if importlib.util.find_spec(package) is None:
        raise _missing(package, feature)


def require(module: str, *, feature: str) -> ModuleType:
    """``import module`` (one of the backends or a submodule of it) for ``feature``, e.g.
    ``require("torchao.optim", feature="Adam8bit(backend='torchao')").AdamW8bit``.

    Raises:
        MissingExtraError: the backend is not installed. A module missing *inside* an installed backend (one of its
            own dependencies, a submodule another version moved) is re-raised as it is: its message says what.
    """
    package = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != package:
            raise
        raise _missing(package, feature) from err
