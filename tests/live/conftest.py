"""Live cluster fixtures: a frontend (the real app on uvicorn in a thread) over real instance processes."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from tests.utils import make_tiny_checkpoint, serve_in_thread

MAX_MODEL_LEN = 256
INSTANCE_ARGS = ["--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks", "128",
                 "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--profile-tokens", "16,64"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("live_model") / "tiny", "llama"))


@dataclass
class RunningCluster:
    url: str
    engine: object  # ClusterEngine
    server: uvicorn.Server
    thread: threading.Thread

    def cluster(self) -> list[dict]:
        return httpx.get(f"{self.url}/cluster", timeout=10).json()["instances"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the frontend did not stop"


def instance_args(model: str, policy: str = "prefill_first", *extra: str) -> list[str]:
    return ["--model", model, "--scheduling-policy", policy, *INSTANCE_ARGS, *extra]


def engine_args(model: str) -> list[str]:
    """What `ecoserve serve` passes every instance (the strategy adds the policy and the budget)."""
    return ["--model", model, *INSTANCE_ARGS]


def start_cluster(model: str, controller_factory, num_instances: int, args_for, options=None) -> RunningCluster:
    """A ClusterEngine with `controller_factory` over local instance processes, served by the real app."""
    from ecoserve.live.frontend import ClusterEngine
    from ecoserve.live.launchers import LocalLauncher
    from ecoserve.live.shared import FrontendOptions

    launcher = LocalLauncher(args_for, env={"OMP_NUM_THREADS": "1"})
    return serve(ClusterEngine(model_facts(model), controller_factory, list(range(num_instances)), launcher,
                               options or FrontendOptions()))


def start_strategy(model: str, strategy: str, num_instances: int, instance_args: list[str], ttft_slo: float = 2.0,
                   tpot_slo: float = 0.5, launcher: str = "local", app_kwargs: dict | None = None,
                   **controller) -> RunningCluster:
    """The cluster `ecoserve serve --strategy` builds (real controllers), in this process."""
    from ecoserve.live.serve import LiveCluster, build_cluster

    free = controller.pop("num_free_instances", 0)
    spec = LiveCluster(strategy, num_instances, free, controller, tuple(instance_args), launcher)
    return serve(build_cluster(model_facts(model), spec, spec.options(ttft_slo, tpot_slo, 512)), app_kwargs)


def model_facts(model: str):
    """What the frontend knows of the model (no weights), as `ecoserve serve --strategy` reads it."""
    from ecoserve.engine.async_engine import ModelFacts
    from ecoserve.model.loader import load_model_info

    return ModelFacts.of(load_model_info(model), MAX_MODEL_LEN)


def serve(engine, app_kwargs: dict | None = None) -> RunningCluster:
    """The OpenAI app with the cluster routes over `engine`, on uvicorn in a thread; returns once every
    instance has joined (as `ecoserve serve --strategy` composes them)."""
    from ecoserve.live.routes import cluster_router
    from ecoserve.server.app import create_app

    url, server, thread = serve_in_thread(create_app(engine, "tiny", routers=[cluster_router(engine)],
                                                     enable_admin_api=True, **(app_kwargs or {})))
    deadline = time.monotonic() + 240
    while True:
        assert time.monotonic() < deadline and thread.is_alive(), "the cluster did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return RunningCluster(url, engine, server, thread)
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def single_engine_greedy(model: str, prompts: list[str], max_tokens: int, policy: str = "prefill_first") -> list:
    """The reference: one in-process engine, one prompt at a time (batch shapes match the cluster's)."""
    from ecoserve.engine.llm import LLM
    from ecoserve.sampling import SamplingParams

    llm = LLM(model, num_threads=1, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=128, max_num_seqs=16,
              max_num_batched_tokens=512, scheduling_policy=policy)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]


os.environ.setdefault("OMP_NUM_THREADS", "1")


def write_profile(path, rows: list[tuple[int, float]]) -> str:
    """A `tokens,ms` CSV for `--mock-profile`."""
    path.write_text("tokens,ms\n" + "".join(f"{n},{ms}\n" for n, ms in rows))
    return str(path)


def mock_args(model: str, profile: str, policy: str = "prefill_first", *extra: str) -> list[str]:
    return ["--model", model, "--mock-profile", profile, "--scheduling-policy", policy, "--num-gpu-blocks", "1024",
            "--max-model-len", str(MAX_MODEL_LEN), "--heartbeat-interval", "0.2", *extra]
