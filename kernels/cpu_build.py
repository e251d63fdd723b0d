"""Builds and loads a native kernel library for one ``-march`` target, cached on disk under a key
of what decides the machine code (compiler, flags, the ISA the target resolves to, sources), and
never loads a library that uses instructions this CPU lacks.

``-march=native`` resolves differently on each CPU, so a cache directory shared between machines
(an NFS home, a container image built elsewhere) holds one file per CPU kind instead of handing an
AVX-512 build to an AVX2 host, where the first kernel call would die with SIGILL.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from baton_serve.kernels import capabilities

# No -ffast-math: linking it into a shared object sets flush-to-zero for the whole process.
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-ffp-contract=fast", "-Wno-psabi", "-shared", "-fPIC")
ISA_SYMBOL = "baton_kernel_isa"  # const char *(void): the ISA macros the library was compiled with


class KernelBuildError(RuntimeError):
    """The native kernels cannot be built here (no compiler, or it failed)."""


class UnsupportedTarget(RuntimeError):
    """A kernel build would use instructions this CPU does not have; it is never loaded."""


def cache_dir() -> Path:
    root = os.environ.get("BATON_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "baton")
    return Path(root) / "kernels"


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise KernelBuildError("no C compiler found")
    return cc


def target_macros(cc: str, target: str) -> frozenset[str]:
    """The macros ``cc -march=target`` predefines: the ISA the build may use, as the compiler
    resolves the target on this machine."""
    try:
        out = subprocess.run([cc, f"-march={target}", "-dM", "-E", "-x", "c", os.devnull], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(f"{cc} does not take -march={target}: {getattr(exc, 'stderr', '') or exc}") from None
    return frozenset(line.split()[1] for line in out.splitlines() if line.startswith("#define "))


def required_flags(macros: frozenset[str] | set[str]) -> set[str]:
    """The CPU flags (``/proc/cpuinfo`` names) a build with these macros needs."""
    return {flag for macro, flag in capabilities.MACRO_FLAGS.items() if macro in macros}


def _check_runs_here(required: set[str], what: str) -> None:
    missing = capabilities.cpu().missing(required)
    if missing:
        raise UnsupportedTarget(f"{what} uses {', '.join(sorted(missing))}, which this CPU "
                                f"({capabilities.cpu().model_name or 'unknown'}) does not have")


def library_path(sources: Sequence[Path], target: str, cc: str, macros: frozenset[str]) -> Path:
    """Where the build of ``sources`` for ``target`` is cached (its name carries the key)."""
    flags = [*FLAGS, f"-march={target}"]
    digest = hashlib.sha256("\0".join([cc, *flags, *sorted(macros)]).encode())
    for src in (*sources, *sorted(Path(sources[0]).parent.glob("*.h"))):  # headers change the build too
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    name = "".join(c if c.isalnum() else "_" for c in target)
    return cache_dir() / f"baton_cpu_{name}_{digest.hexdigest()[:16]}.so"


def _compile_and_link(cc: str, target: str, sources: Sequence[Path], out: Path) -> None:
    """One compiler process per source, as many at once as there are cores (the first start on a
    new CPU kind waits for the slowest file, not the sum), then one link."""
    objects = [out.with_name(f"{i}-{Path(src).stem}.o") for i, src in enumerate(sources)]

    def compile_one(src_obj: tuple[Path, Path]) -> None:
        src, obj = src_obj
        subprocess.run([cc, *FLAGS, f"-march={target}", "-c", "-o", str(obj), str(src)],
                       check=True, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=max(min(len(sources), os.cpu_count() or 1), 1)) as pool:
        list(pool.map(compile_one, zip(sources, objects)))
    subprocess.run([cc, *FLAGS, f"-march={target}", "-o", str(out), *map(str, objects), "-lm"],
                   check=True, capture_output=True, text=True)


def build(sources: Sequence[Path], signatures: Mapping[str, tuple[Any, list[Any]]], target: str) -> ctypes.CDLL:
    """Compile (or reuse the cached build of) ``sources`` for ``-march=target``, load it and set the
    ctypes ``signatures``. Raises ``UnsupportedTarget`` when the build would use, or the cached file
    was compiled with, instructions this CPU lacks; ``KernelBuildError`` when it cannot be built."""
    cc = compiler()
    macros = target_macros(cc, target)
    _check_runs_here(required_flags(macros), f"-march={target}")
    path = library_path(sources, target, cc, macros)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            try:
                _compile_and_link(cc, target, sources, out)
            except (OSError, subprocess.CalledProcessError) as exc:
                raise KernelBuildError(f"building the CPU kernels failed: {getattr(exc, 'stderr', '') or exc}"
                                       ) from None
            os.replace(out, path)  # atomic: concurrent builders each install a complete file
    lib = ctypes.CDLL(str(path))
    # The file's name says what it was built for; the library itself says what it was compiled
    # with. Both must fit this CPU (a file copied in by hand, a cache written by another machine).
    # ISA_SYMBOL only returns a constant, so calling it is safe on any CPU.
    isa_fn = getattr(lib, ISA_SYMBOL)
    isa_fn.restype, isa_fn.argtypes = ctypes.c_char_p, []
    compiled = {form for m in isa_fn().decode().split() for form in (f"__{m}__", f"__{m}")}  # x86, Arm spellings
    _check_runs_here(required_flags(compiled), str(path))
    for fn_name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, fn_name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def isa(lib: ctypes.CDLL) -> str:
    """The instruction sets a built library's kernels use, e.g. ``AVX AVX2 FMA F16C``; empty for a
    baseline build."""
    return getattr(lib, ISA_SYMBOL)().decode().strip()
