"""EcoServe's cluster policies as pure code: controllers, statuses, routers, mitosis, baselines."""
from ecoserve.cluster.baselines import FuDGController, FuDGRouter, NoDGController, NoDGRouter
from ecoserve.cluster.controller import StatusBoard
from ecoserve.cluster.mitosis import MitosisConfig, MitosisController
from ecoserve.cluster.padg import PaDGController
from ecoserve.cluster.profile import PrefillProfile
from ecoserve.cluster.router import Check, MacroInstance, RouterConfig
from ecoserve.cluster.status import InstanceStatus, RequestState, instance_status
from ecoserve.cluster.strategies import CONTROLLERS, ControllerOptions, build_controller

__all__ = ["CONTROLLERS", "Check", "ControllerOptions", "FuDGController", "FuDGRouter", "InstanceStatus",
           "MacroInstance", "MitosisConfig", "MitosisController", "NoDGController", "NoDGRouter", "PaDGController",
           "PrefillProfile", "RequestState", "RouterConfig", "StatusBoard", "build_controller", "instance_status"]
