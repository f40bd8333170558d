"""V17 strategies, installed as ``lightning_v17.strategies`` (setuptools package-dir maps this folder there).

Importing this package registers the aliases "v17", "v17_zero1", "v17_zero2" and "v17_zero3" in Lightning's
``StrategyRegistry``, so ``Trainer(strategy="v17_zero3")`` works once ``lightning_v17.strategies`` (or
``lightning_v17.V17Strategy``) has been imported, and the same aliases in Fabric's ``STRATEGY_REGISTRY`` for
:class:`V17FabricStrategy` (``Fabric(strategy="v17_zero3")``).
"""

if __name__ != "lightning_v17.strategies":  # pragma: no cover - guards against `import strategies`
    raise ImportError(
        f"this folder must be imported as 'lightning_v17.strategies', not {__name__!r}; "
        "install the package (`pip install -e .`) and import it absolutely"
    )

from lightning.fabric.strategies import STRATEGY_REGISTRY as FabricStrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry
from lightning_v17.strategies.fabric import V17FabricStrategy
from lightning_v17.strategies.v17 import V17Strategy

if "v17" not in StrategyRegistry:
    V17Strategy.register_strategies(StrategyRegistry)
if "v17" not in FabricStrategyRegistry:
    V17FabricStrategy.register_strategies(FabricStrategyRegistry)

__all__: list[str] = ["V17FabricStrategy", "V17Strategy"]
