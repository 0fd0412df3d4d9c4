"""EcoServe's cluster policies as pure code: controllers, statuses, routers, mitosis, baselines."""
from ecoserve.cluster.baselines import FuDGController, FuDGRouter, NoDGController, NoDGRouter
from ecoserve.cluster.events import ClusterController, InstanceSetup
from ecoserve.cluster.mitosis import MitosisConfig, MitosisController
from ecoserve.cluster.padg import PaDGController
from ecoserve.cluster.profile import PrefillProfile, StepTimeTable
from ecoserve.cluster.router import Check, MacroInstance, RouterConfig
from ecoserve.cluster.status import InstanceStatus, RequestState, StatusOf, instance_status
from ecoserve.cluster.strategies import STRATEGIES, ControllerOptions, build_controller, setups_for
from ecoserve.cluster.topology import MacroTopology, Topology

__all__ = ["STRATEGIES", "Check", "ClusterController", "ControllerOptions", "FuDGController", "FuDGRouter",
           "InstanceSetup", "InstanceStatus", "MacroInstance", "MacroTopology", "MitosisConfig", "MitosisController",
           "NoDGController", "NoDGRouter", "PaDGController", "PrefillProfile", "RequestState", "RouterConfig",
           "StatusOf", "StepTimeTable", "Topology", "build_controller", "instance_status", "setups_for"]
