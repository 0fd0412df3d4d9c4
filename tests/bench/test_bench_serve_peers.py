"""scripts/bench_serve_peers.py: every server gets the same dtype, vLLM's through its own `--dtype` flag."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_serve_peers.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_serve_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_server_runs_the_dtype_asked_for(script, tmp_path, dtype):
    args = script.parse_args(["--peer-python", "/venv/bin/python", "--model-dir", str(tmp_path), "--dtype", dtype])
    for system in ("ecoserve", "ecoserve-core", "vllm"):
        cmd, env = script.server_command(system, args, 18700)
        assert cmd[cmd.index("--dtype") + 1] == dtype and cmd.count("--dtype") == 1, cmd
        assert env["OMP_NUM_THREADS"] == "1"
    vllm, _ = script.server_command("vllm", args, 18700)
    assert vllm[:2] == ["/venv/bin/vllm", "serve"]


def test_the_default_dtype_is_float32(script, tmp_path):
    args = script.parse_args(["--peer-python", "/venv/bin/python", "--model-dir", str(tmp_path)])
    assert args.dtype == "float32"


def test_a_server_that_dies_before_it_is_ready_is_reported_and_reaped(script, tmp_path):
    import sys

    log = tmp_path / "server.log"
    with pytest.raises(SystemExit, match="exited with 3 before it was ready"):
        with script.serving([sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"], None, 1, "0", log, 30):
            pytest.fail("a dead server must not be yielded")
    assert log.read_text().strip() == "bye"
