"""The kernels' build cache (kvbridge.ops.jit) without a GPU: what the build key covers,
where builds live, the file lock that makes concurrent processes build once, the atomic
install, the error and cleanup of a failed build, and KVBRIDGE_DISABLE_JIT.

torch's ``cpp_extension.load`` (nvcc and a CUDA torch) is replaced by a stand-in that
writes the library file the real one would, so everything around it runs for real."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from kvbridge.ops import jit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty build cache, a known arch (no GPU needed to name one) and no library
    loaded in this process yet."""
    monkeypatch.setenv("KVBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVBRIDGE_CUDA_ARCH", "9.0")
    monkeypatch.delenv("KVBRIDGE_DISABLE_JIT", raising=False)
    monkeypatch.delenv("KVBRIDGE_CSRC_DIR", raising=False)
    monkeypatch.setattr(jit, "_state", {})
    return tmp_path / "cache" / "ops"


def fake_load(calls: list, fail: str | None = None):
    """A stand-in for cpp_extension.load: records the call and writes the library into
    the build directory (or raises like a compiler error)."""

    def load(*, name, sources, build_directory, **kwargs):
        calls.append(
            {
                "name": name,
                "sources": sources,
                "arch": os.environ.get("TORCH_CUDA_ARCH_LIST"),
                **kwargs,
            }
        )
        if fail:
            raise RuntimeError(fail)
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF")
        return

    return load


def test_build_key_covers_sources_flags_arch_and_versions(cache, tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", src)
    monkeypatch.setenv("KVBRIDGE_CSRC_DIR", str(src))
    base = jit.build_key("9.0")
    assert jit.build_key("9.0") == base  # deterministic
    assert jit.build_key("8.0") != base
    (src / "tile_map.h").write_text((src / "tile_map.h").read_text() + "\n")  # a header byte
    assert jit.build_key("9.0") != base
    shutil.copy(ROOT / "csrc/tile_map.h", src / "tile_map.h")
    assert jit.build_key("9.0") == base
    flags = jit.CUDA_FLAGS
    monkeypatch.setattr(jit, "CUDA_FLAGS", (*flags, "-G"))
    assert jit.build_key("9.0") != base
    monkeypatch.setattr(jit, "CUDA_FLAGS", flags)
    monkeypatch.setattr("torch.__version__", "0.0.0")
    assert jit.build_key("9.0") != base


def test_library_lives_under_the_cache_dir(cache):
    path = jit.library_path()
    assert path.parent.parent == cache and path.name == f"{jit.LIB_NAME}.so"
    assert path.parent.name == jit.build_key("9.0")


def test_build_installs_once_and_reuses(cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(cpp_extension, "load", fake_load(calls))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5")
    path = jit.build()
    assert path == jit.library_path() and path.is_file()
    assert len(calls) == 1 and calls[0]["arch"] == "9.0" and calls[0]["name"] == jit.LIB_NAME
    assert sorted(Path(s).name for s in calls[0]["sources"]) == sorted(jit.SOURCES)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "7.5"  # restored
    assert jit.build() == path and len(calls) == 1  # cached: no second compile
    # nothing but the build and its lock file is left in the cache
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [path.parent.name, path.parent.name + ".lock"]
    )


def test_failed_build_raises_with_fix_and_leaves_nothing(cache, monkeypatch):
    monkeypatch.setattr(
        cpp_extension, "load", fake_load([], fail="nvcc fatal: unsupported gpu architecture")
    )
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    with pytest.raises(jit.KernelBuildError, match="unsupported gpu architecture") as err:
        jit.build()
    assert "check nvcc" in str(err.value) and "KVBRIDGE_DISABLE_JIT" in str(err.value)
    assert not jit.library_path().parent.exists()
    # no half-built directory
    assert [p.name for p in cache.iterdir()] == [jit.library_path().parent.name + ".lock"]
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ


def test_try_load_falls_back_once_when_jit_is_disabled(cache, monkeypatch, caplog):
    calls: list = []
    monkeypatch.setattr(cpp_extension, "load", fake_load(calls))
    monkeypatch.setenv("KVBRIDGE_DISABLE_JIT", "1")
    with caplog.at_level(logging.WARNING, logger="kvbridge.ops.jit"):
        assert jit.try_load() is False
        assert jit.try_load() is False
    assert calls == []
    warnings = [r.getMessage() for r in caplog.records]
    assert (
        len(warnings) == 1
        and "KVBRIDGE_DISABLE_JIT" in warnings[0]
        and "kvbridge build-ops" in warnings[0]
    )


def test_a_wrong_csrc_dir_is_an_error_not_a_fallback(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_CSRC_DIR", str(tmp_path))
    with pytest.raises(jit.KernelBuildError, match=r"lacks api\.cpp, kv_pack\.cu") as err:
        jit.source_dir()
    assert "unset it" in str(err.value)
    monkeypatch.delenv("KVBRIDGE_CSRC_DIR")
    assert (jit.source_dir() / "kv_pack.cu").is_file()


CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from torch.utils import cpp_extension
    from kvbridge.ops import jit

    log, gates, me, n = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])

    def load(*, name, build_directory, **kwargs):
        with open(log, "a") as f:
            f.write(f"compile {me}\\n")
        # hold the build until every process has reached its own build() call
        deadline = time.monotonic() + 60
        while len(list(gates.iterdir())) < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the other processes never started")
            time.sleep(0.01)
        (Path(build_directory) / f"{name}.so").write_bytes(b"ok")

    cpp_extension.load = load
    (gates / me).touch()
    print(jit.build())
    """
)


def test_concurrent_processes_build_once(cache, tmp_path):
    log, gates = tmp_path / "log", tmp_path / "gates"
    gates.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    n = 3
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(log), str(gates), str(i), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        for i in range(n)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    assert len(log.read_text().splitlines()) == 1  # one compile, the others waited for it
    paths = {out.strip() for out, _ in results}
    assert paths == {str(jit.library_path())} and jit.library_path().read_bytes() == b"ok"
