"""What /cluster shows of an instance: the driver's own state, placed in the controller's topology."""
from __future__ import annotations

from ecoserve.cluster.topology import Topology
from ecoserve.live.board import InstanceHandle, view_of

TOPOLOGY = Topology({0: "both", 1: "both", 2: "both", 3: "both"}, {0: (0,), 1: (1,)}, free=(2,), draining=(3,))


def _view(iid: int, state: str = "ready", topology: Topology | None = TOPOLOGY):
    return view_of(InstanceHandle(iid, state=state), topology, 0, 0.0)


def test_macro_members_free_and_draining():
    assert [(v.state, v.role) for v in map(_view, range(4))] == [("ready", 0), ("ready", 1), ("free", None),
                                                                  ("draining", None)]


def test_the_driver_state_wins_over_the_topology():
    assert _view(2, "starting").state == "starting" and _view(3, "lost").state == "lost"


def test_fudg_roles_and_no_controller_yet():
    fudg = Topology({0: "prefill", 1: "decode"})
    assert [view_of(InstanceHandle(i, state="ready"), fudg, 0, 0.0).role for i in (0, 1)] == ["prefill", "decode"]
    assert _view(0, topology=Topology({0: "both"})).role is None
    assert (_view(2, topology=None).state, _view(2, topology=None).role) == ("ready", None)
