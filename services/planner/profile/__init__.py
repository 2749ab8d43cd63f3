"""A pod's measured costs: the `Profile` the simulator reads (`cost_model.py`) and the parts it
is made of (`parts.py`), importable from here. How a profile is measured is `planner.measure`'s;
this package imports nothing of the planner's but itself, so everything else may import it."""

from splitserve.planner.profile.cost_model import (
    DEFAULT_MARGIN,
    Profile,
    load_profile,
    synthetic_profile,
)
from splitserve.planner.profile.parts import (
    DecodeGrid,
    EngineSetup,
    KVTransferModel,
    MixedGrid,
    NeighborSlowdown,
    PrefillSample,
    ServingCosts,
    TierLoadModel,
)

__all__ = [
    "DEFAULT_MARGIN",
    "DecodeGrid",
    "EngineSetup",
    "KVTransferModel",
    "MixedGrid",
    "NeighborSlowdown",
    "PrefillSample",
    "Profile",
    "ServingCosts",
    "TierLoadModel",
    "load_profile",
    "synthetic_profile",
]
