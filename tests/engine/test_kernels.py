"""The native kernels' build folder: a lock left by a killed build must not hang later starts, and a
build for one CPU is never loaded on another."""
import os
import time

from ecoserve import kernels


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


def test_build_folder_names_the_instruction_set(tmp_path, monkeypatch):
    """A cache shared by machines of different CPUs keeps one `-march=native` build per instruction set."""
    monkeypatch.setenv("ECOSERVE_CACHE", str(tmp_path))
    base = {"fpu", "sse2", "ssse3", "avx", "avx2", "fma", "f16c"}
    folders = {}
    for name, flags in {"avx2": base, "avx2+vnni": base | {"avx_vnni"}, "avx512": base | {"avx512f", "avx512bw"},
                        "avx512+vbmi2": base | {"avx512f", "avx512bw", "avx512_vbmi2"}}.items():
        monkeypatch.setattr(kernels, "cpu_flags", lambda flags=flags: frozenset(flags))
        folders[name] = kernels._build_dir("quant_matmul")
        assert folders[name].name == "quant_matmul" and folders[name].is_dir()
    assert len(set(folders.values())) == 4
    assert folders["avx2"].parent.name.startswith("avx2-") and "avxvnni" in folders["avx2+vnni"].parent.name
    assert folders["avx512"].parent.name.startswith("avx512-")
    # flags that are no instruction set (a hypervisor, a mitigation) do not force a rebuild
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(base | {"hypervisor", "ibrs"}))
    assert kernels._build_dir("quant_matmul") == folders["avx2"]


def test_isa_tag_without_cpuinfo_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", frozenset)
    import torch

    assert kernels.isa_tag().endswith(torch.backends.cpu.get_cpu_capability().lower())
