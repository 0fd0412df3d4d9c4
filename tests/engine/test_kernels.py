"""The native kernels' build folder: a lock left by a killed build must not hang later starts, and a
build for one CPU is never loaded on another."""
import os
import time

import pytest

from ecoserve import kernels
from ecoserve.kernels import cpu


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
    ninja = pytest.importorskip("ninja")
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
        monkeypatch.setattr(cpu, "cpu_flags", lambda flags=flags: frozenset(flags))
        folders[name] = kernels._build_dir("quant_matmul")
        assert folders[name].name == "quant_matmul" and folders[name].is_dir()
    assert len(set(folders.values())) == 4
    assert folders["avx2"].parent.name.startswith("avx2-") and "avxvnni" in folders["avx2+vnni"].parent.name
    assert folders["avx512"].parent.name.startswith("avx512-")
    # flags that are no instruction set (a hypervisor, a mitigation) do not force a rebuild
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(base | {"hypervisor", "ibrs"}))
    assert kernels._build_dir("quant_matmul") == folders["avx2"]


def test_isa_tag_without_cpuinfo_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", frozenset)
    import torch

    assert kernels.isa_tag().endswith(torch.backends.cpu.get_cpu_capability().lower())


def test_lower_isa_build_has_its_own_folder_and_vector_width():
    """The AVX2 build of a kernel on an AVX-512 machine: its own module and folder, 8-float vectors. (On an
    AVX2-only machine the loaders reuse the native build instead, tested in tests/kernels/test_cpu.py.)"""
    if kernels.distinct_builds() == ["native"]:
        pytest.skip("this CPU's native build is the AVX2 build")
    module = kernels._load("paged_decode", "torch SDPA", isa="avx2")
    if module is None:
        pytest.skip("no AVX2 build on this machine (compiler or CPU)")
    assert module.simd_width() == 8
    folder = os.path.dirname(module.__file__)
    assert os.path.basename(os.path.dirname(folder)) == kernels.isa_tag() + "-as-avx2"
    native = kernels._load("paged_decode", "torch SDPA")
    if native is not None and "avx512f" in kernels.cpu_flags():
        assert native.simd_width() == 16 and os.path.dirname(native.__file__) != folder


def test_lower_isa_the_cpu_lacks_is_not_built(monkeypatch, tmp_path):
    """A binary for instructions this CPU lacks would crash on load: no build, the torch path instead."""
    monkeypatch.setenv("ECOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    assert kernels._load.__wrapped__("paged_decode", "torch SDPA", isa="avx2") is None
    assert not (tmp_path / "kernels").exists()


def _attention_benchmark(*args: str) -> str:
    """stdout of scripts/bench_attention_kernels.py (the command the kernel figures come from), tiny shapes."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "scripts" / "bench_attention_kernels.py"), "--seqs", "2",
                          "--context", "20", "--repeats", "1", *args],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_attention_kernel_benchmark_runs_every_dtype_pair():
    if kernels.paged_prefill() is None:
        pytest.skip("no native kernels on this machine")
    out = _attention_benchmark("--prompts", "2", "--prompt-len", "16")
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("native", "sdpa"))]
    assert len([r for r in rows if r[0] == "native"]) == 8 and len([r for r in rows if r[0] == "sdpa"]) == 4
    assert all(float(r[5]) > 0 for r in rows)


def test_attention_kernel_benchmark_times_decode_alone_over_several_runs():
    """`--kernels decode --runs 2`: the decode rows twice, no prefill rows."""
    if kernels.paged_decode() is None:
        pytest.skip("no native kernels on this machine")
    out = _attention_benchmark("--kernels", "decode", "--runs", "2")
    assert out.count("decode:") == 2 and "prefill:" not in out
    assert len([line for line in out.splitlines() if line.strip().startswith("native")]) == 8
