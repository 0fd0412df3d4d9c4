"""EcoServe's cluster policies as pure code: statuses, Algorithm 1 router, mitosis, baselines."""
from ecoserve.cluster.baselines import FuDGRouter, NoDGRouter
from ecoserve.cluster.mitosis import Action, MitosisConfig, MitosisController
from ecoserve.cluster.router import Check, MacroInstance, RouterConfig
from ecoserve.cluster.status import InstanceStatus, RequestState

__all__ = ["Action", "Check", "FuDGRouter", "InstanceStatus", "MacroInstance", "MitosisConfig",
           "MitosisController", "NoDGRouter", "RequestState", "RouterConfig"]
