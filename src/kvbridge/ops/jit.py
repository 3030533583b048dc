"""Build and load the CUDA kernels of ``csrc/`` (``torch.ops.kvbridge.pack`` / ``unpack``).

Who calls: :mod:`kvbridge.ops`, on the first pack or unpack of a CUDA tensor
(:func:`try_load`); ``kvbridge build-ops`` (or ``python -m kvbridge.ops.jit``) to build
ahead of time (:func:`build`), e.g. in a container image.

Cache: one directory per build key, ``<cache>/ops/<key>/``, where the key hashes the
sources, the compiler flags, the GPU architecture, torch's and CUDA's versions and
kvbridge's. ``<cache>`` is ``$KVBRIDGE_CACHE_DIR`` or ``~/.cache/kvbridge``. A build runs
under a file lock (concurrent processes build once), in a temporary directory that is
renamed into place when complete, so a half-built library is never loaded.

Environment:
- ``KVBRIDGE_CACHE_DIR``: where builds live;
- ``KVBRIDGE_DISABLE_JIT=1``: never compile; load a build that already exists or use
  the torch reference;
- ``KVBRIDGE_CUDA_ARCH``: target architecture, e.g. ``9.0`` (default: the current GPU's);
- ``KVBRIDGE_CSRC_DIR``: the kernel sources (default: the package's ``csrc``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from kvbridge.errors import KVBridgeError

log = logging.getLogger(__name__)

LIB_NAME = "kvbridge_ops"
SOURCES = ("api.cpp", "kv_pack.cu")
HEADERS = ("kv_pack.h", "tile_map.h")
CFLAGS = ("-O3",)
CUDA_FLAGS = ("-O3", "-lineinfo")
"""No ``--use_fast_math``: the kernels must round exactly like the torch reference. No
``-std``: torch's build passes the standard its own headers are written for (torch 2.13:
C++20, which an explicit C++17 after it overrode); the sources build as C++17 and C++20."""

_lock = threading.Lock()
_state: dict[str, object] = {}


class KernelBuildError(KVBridgeError):
    """The CUDA kernels could not be built or loaded."""


def source_dir() -> Path:
    """Where the kernel sources are: ``$KVBRIDGE_CSRC_DIR`` when set (and nowhere else:
    a wrong setting is an error, not a silent fallback), else the installed package's
    copy or the source checkout's ``csrc/``."""
    files = SOURCES + HEADERS
    env = os.environ.get("KVBRIDGE_CSRC_DIR")
    if env:
        missing = [name for name in files if not (Path(env) / name).is_file()]
        if missing:
            raise KernelBuildError(
                f"KVBRIDGE_CSRC_DIR={env} lacks {', '.join(missing)}",
                fix=(
                    "point KVBRIDGE_CSRC_DIR at kvbridge's csrc directory, or unset it to use the "
                    "installed sources"
                ),
            )
        return Path(env)
    here = Path(__file__).resolve().parent
    candidates = [here / "csrc", here.parents[2] / "csrc"]
    for c in candidates:
        if all((c / name).is_file() for name in files):
            return c
    raise KernelBuildError(
        f"kernel sources not found (looked in {', '.join(map(str, candidates))})",
        fix="reinstall kvbridge, or point KVBRIDGE_CSRC_DIR at kvbridge's csrc directory",
    )


def cache_dir() -> Path:
    return Path(os.environ.get("KVBRIDGE_CACHE_DIR") or Path.home() / ".cache" / "kvbridge") / "ops"


def jit_disabled() -> bool:
    return os.environ.get("KVBRIDGE_DISABLE_JIT", "").lower() in ("1", "true", "yes")


def target_arch() -> str:
    import torch

    arch = os.environ.get("KVBRIDGE_CUDA_ARCH")
    if arch:
        return arch
    if not torch.cuda.is_available():
        raise KernelBuildError(
            "no CUDA device to build for",
            fix="set KVBRIDGE_CUDA_ARCH (e.g. 9.0) to build without one",
        )
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def build_key(arch: str) -> str:
    """Hash of everything that changes the binary."""
    import torch

    from kvbridge import __version__

    h = hashlib.sha256()
    src = source_dir()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    for part in (
        CFLAGS,
        CUDA_FLAGS,
        (arch, torch.__version__, str(torch.version.cuda), __version__),
    ):
        h.update("\0".join(part).encode())
    return h.hexdigest()[:16]


def library_path(arch: str | None = None) -> Path:
    return cache_dir() / build_key(arch or target_arch()) / f"{LIB_NAME}.so"


def build(arch: str | None = None, verbose: bool = False) -> Path:
    """Compile the kernels for ``arch`` into the cache (no-op when already built) and
    return the library's path. Raises :class:`KernelBuildError` on failure."""
    from filelock import FileLock, Timeout

    arch = arch or target_arch()
    final = library_path(arch)
    if final.is_file():
        return final
    final.parent.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(final.parent) + ".lock", timeout=1800):
            if final.is_file():  # built by another process while we waited
                return final
            return _compile(arch, final, verbose)
    except Timeout as exc:
        raise KernelBuildError(
            f"timed out waiting for another process building {final.parent}"
        ) from exc


def _compile(arch: str, final: Path, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    src = source_dir()
    tmp = Path(tempfile.mkdtemp(prefix=final.parent.name + ".", dir=final.parent.parent))
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        log.info(
            "kvbridge: building CUDA kernels for sm_%s in %s (once per version)",
            arch.replace(".", ""),
            tmp,
        )
        built = cpp_extension.load(
            name=LIB_NAME,
            sources=[str(src / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_cuda_cflags=list(CUDA_FLAGS),
            extra_include_paths=[str(src)],
            build_directory=str(tmp),
            is_python_module=False,
            is_standalone=False,
            verbose=verbose,
        )
        del built
        so = tmp / f"{LIB_NAME}.so"
        if not so.is_file():
            raise KernelBuildError(f"the build finished without {so}")
        tmp.rename(final.parent)  # atomic: the directory appears complete or not at all
        _state["loaded"] = str(final)  # cpp_extension.load already loaded it
        return final
    except KernelBuildError:
        raise
    except Exception as exc:  # compiler errors come as RuntimeError / CalledProcessError
        raise KernelBuildError(
            f"building the CUDA kernels failed: {exc}",
            fix="check nvcc and the CUDA toolkit, or set KVBRIDGE_DISABLE_JIT=1",
        ) from exc
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
        shutil.rmtree(tmp, ignore_errors=True)


def load(path: Path | None = None) -> None:
    """Load the built library into this process (once). Raises on failure."""
    import torch

    with _lock:
        if "loaded" in _state:
            return
        path = path or build()
        if "loaded" not in _state:
            try:
                torch.ops.load_library(str(path))
            except Exception as exc:
                raise KernelBuildError(
                    f"loading {path} failed: {exc}", fix="delete the directory to rebuild it"
                ) from exc
            _state["loaded"] = str(path)


def try_load() -> bool:
    """True when ``torch.ops.kvbridge`` kernels are usable. Never raises: a failure is
    logged once and the reference implementation is used instead."""
    if "loaded" in _state:
        return True
    if "failed" in _state:
        return False
    try:
        path = library_path()
        if not path.is_file():
            if jit_disabled():
                raise KernelBuildError(
                    f"KVBRIDGE_DISABLE_JIT is set and no build exists at {path}",
                    fix="run `kvbridge build-ops`",
                )
            path = build()
        load(path)
        return True
    except Exception as exc:  # noqa: BLE001 - this function's contract is to never raise
        _state["failed"] = str(exc)
        log.warning(
            "kvbridge: CUDA kernels unavailable, using the torch reference on the GPU: %s", exc
        )
        return False


if __name__ == "__main__":
    from kvbridge.cli import main

    raise SystemExit(main(["build-ops", *__import__("sys").argv[1:]]))
