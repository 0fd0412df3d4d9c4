"""Starting instance processes: `local` subprocesses (the default) or `ray` actors for several nodes.

A launcher starts an instance that connects back to the frontend's address, says whether it has
exited (and how), kills it, and shuts all of them down. Ray is an optional extra
(`pip install 'ecoserve[ray]'`); it is imported only when the `ray` launcher is chosen.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from ecoserve.live.auth import ClusterAuth

logger = logging.getLogger(__name__)

REAP_TIMEOUT_S = 10.0  # how long a relaunch waits for the killed process to end

ArgsFor = Callable[[int], list[str]]  # instance id -> `ecoserve instance` arguments (besides --connect)


class Launcher(Protocol):
    def launch(self, instance_id: int, connect: str) -> int | None:
        """Start one instance; its pid if known now (the frontend matches it with the instance's `Ready`)."""
        ...

    def exit_code(self, instance_id: int) -> int | None:
        """None while it runs; its exit status once it has ended."""
        ...

    def kill(self, instance_id: int) -> None: ...

    def relaunch(self, instance_id: int, connect: str) -> int | None:
        """Replace a lost instance in the same slot: make sure the old one is gone, then start a new one.
        May block (a Ray actor takes seconds to place): the frontend calls it off its event loop."""
        ...

    def shutdown(self, timeout_s: float) -> None: ...


def instance_command(connect: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ecoserve.cli", "instance", "--connect", connect, *args]


class LocalLauncher:
    """Each instance is a subprocess of the frontend, on this machine.

    `key_dir`: the cluster's key set, passed as `--cluster-key-dir` (None: `--cluster-auth none`);
    `owns_key_dir`: a per-run temporary directory, removed at shutdown."""

    def __init__(self, args_for: ArgsFor, env: dict[str, str] | None = None, log_dir: str | None = None,
                 key_dir: str | None = None, owns_key_dir: bool = False) -> None:
        self.args_for = args_for
        self.env = {**os.environ, **(env or {})}
        self.log_dir = log_dir
        self.key_dir, self.owns_key_dir = key_dir, owns_key_dir
        self.procs: dict[int, subprocess.Popen] = {}
        self.orphans: list[subprocess.Popen] = []  # replaced processes that had not died yet

    def _auth_args(self) -> list[str]:
        return ["--cluster-key-dir", self.key_dir] if self.key_dir else ["--cluster-auth", "none"]

    def launch(self, instance_id: int, connect: str) -> int:
        out = None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"instance-{instance_id}.log"), "ab")
        proc = subprocess.Popen(instance_command(connect, [*self.args_for(instance_id), *self._auth_args()]),
                                env=self.env,
                                stdout=out, stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                # a terminal's Ctrl-C reaches the frontend alone, which drains and then stops them
                                start_new_session=True)
        self.procs[instance_id] = proc
        logger.info("started instance %d as pid %d", instance_id, proc.pid)
        return proc.pid

    def exit_code(self, instance_id: int) -> int | None:
        proc = self.procs.get(instance_id)
        return None if proc is None else proc.poll()

    def kill(self, instance_id: int) -> None:
        proc = self.procs.get(instance_id)
        if proc is not None and proc.poll() is None:
            proc.kill()

    def relaunch(self, instance_id: int, connect: str) -> int:
        old = self.procs.get(instance_id)
        if old is not None:
            old.kill()
            try:
                old.wait(timeout=REAP_TIMEOUT_S)  # reap it: no zombie per restart
            except subprocess.TimeoutExpired:
                logger.warning("instance %d (pid %d) did not die within %.0f s of SIGKILL", instance_id, old.pid,
                               REAP_TIMEOUT_S)
                self.orphans.append(old)
        return self.launch(instance_id, connect)

    def shutdown(self, timeout_s: float) -> None:
        for proc in [*self.procs.values(), *self.orphans]:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("instance pid %d did not exit within %.1f s; killing it", proc.pid, timeout_s)
                proc.kill()
                proc.wait(timeout=timeout_s)
        if self.owns_key_dir and self.key_dir:
            shutil.rmtree(self.key_dir, ignore_errors=True)


def _instance_main(connect: str, args: list[str], auth: ClusterAuth | None) -> int:
    """The body of a Ray actor: the same `ecoserve instance` entry point, in the actor's process. Its KV
    receiver binds this node's address (other nodes must reach it) unless the arguments name one."""
    from ecoserve.live.cli import instance_main
    if "--kv-host" not in args:
        import ray
        args = [*args, "--kv-host", ray.util.get_node_ip_address()]
    if auth is None:
        args = [*args, "--cluster-auth", "none"]
    return instance_main(["--connect", connect, *args], auth)


class RayLauncher:
    """Each instance runs in a Ray actor, placed by Ray on a node with the resources it asks for.

    Ray starts locally when no `address` is given (and is shut down with the cluster then). `auth`, the
    cluster's key set, reaches each actor as a call argument (other nodes do not share this one's disk).
    """

    def __init__(self, args_for: ArgsFor, address: str | None = None, num_cpus: float = 1.0,
                 num_gpus: float = 0.0, resources: dict[str, float] | None = None,
                 auth: ClusterAuth | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--launcher ray needs Ray: pip install 'ecoserve[ray]'") from None
        self.ray = ray
        self.args_for = args_for
        self.auth = auth
        self.started_ray = not ray.is_initialized() and address is None
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     num_cpus=None if address else max(int(os.cpu_count() or 1), 1))
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, max_restarts=0)
        self._actor_cls = remote(_InstanceActor)
        self.actors: dict[int, object] = {}
        self.runs: dict[int, object] = {}  # the ObjectRef of each actor's `run` (ready when it ends)

    def launch(self, instance_id: int, connect: str) -> int:
        actor = self._actor_cls.remote()
        pid = self.ray.get(actor.pid.remote(), timeout=120)
        self.actors[instance_id] = actor
        self.runs[instance_id] = actor.run.remote(connect, self.args_for(instance_id), self.auth)
        logger.info("started instance %d in a Ray actor (pid %d)", instance_id, pid)
        return pid

    def exit_code(self, instance_id: int) -> int | None:
        ref = self.runs.get(instance_id)
        if ref is None:
            return None
        done, _ = self.ray.wait([ref], timeout=0)
        if not done:
            return None
        try:
            return int(self.ray.get(ref))
        except Exception:  # the actor died (killed, node lost)
            return -9

    def kill(self, instance_id: int) -> None:
        actor = self.actors.get(instance_id)
        if actor is not None:
            self.ray.kill(actor)

    def relaunch(self, instance_id: int, connect: str) -> int:
        """A new actor in the same slot (the actors run with max_restarts=0: the frontend decides)."""
        self.kill(instance_id)
        self.actors.pop(instance_id, None)
        self.runs.pop(instance_id, None)
        return self.launch(instance_id, connect)

    def shutdown(self, timeout_s: float) -> None:
        refs = list(self.runs.values())
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for iid in list(self.actors):
            self.kill(iid)
        if self.started_ray:
            self.ray.shutdown()


class _InstanceActor:
    def pid(self) -> int:
        return os.getpid()

    def run(self, connect: str, args: list[str], auth: ClusterAuth | None = None) -> int:
        return _instance_main(connect, args, auth)
