"""The native kernel's build folder: a lock left by a killed build must not hang later starts."""
import os
import time

from ecoserve.engine import kernels


def test_stale_build_lock_is_removed_and_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("ECOSERVE_CACHE", str(tmp_path))
    folder = kernels._build_dir()
    lock = folder / "lock"
    lock.touch()
    assert kernels._build_dir() == folder and lock.exists()  # a build may be running right now
    old = time.time() - kernels._STALE_LOCK_S - 10
    os.utime(lock, (old, old))
    kernels._build_dir()
    assert not lock.exists()


def test_pip_ninja_is_put_on_path_when_none_is_there(monkeypatch):
    ninja = __import__("pytest").importorskip("ninja")
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nowhere")
    kernels._put_ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
