"""SimiGrad in a loop written with Lightning Fabric: :class:`FabricSimiGrad` (docs/fabric.md)."""

from lightning_simigrad.fabric.loop import FabricSimiGrad, FabricWindow

__all__ = ["FabricSimiGrad", "FabricWindow"]
