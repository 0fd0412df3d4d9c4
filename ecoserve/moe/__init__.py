"""Expert placement for mixture-of-experts models: popularity, cost tables and the placement policy.

Pure Python (no torch), so the engine's expert pool and the simulator share one policy.
"""
from ecoserve.moe.costs import CostTable, MeasuredCost, RooflineCost
from ecoserve.moe.placement import LayerPlan, PlacementPolicy, Priority, PrefetchQueue, split_host_device
from ecoserve.moe.popularity import ExpertPopularity

__all__ = ["CostTable", "ExpertPopularity", "LayerPlan", "MeasuredCost", "PlacementPolicy", "Priority",
           "PrefetchQueue", "RooflineCost", "split_host_device"]
