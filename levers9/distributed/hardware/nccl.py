"""The NCCL this process runs with: asked of the library itself, not of torch's build headers.

`torch.cuda.nccl.version()` reports the NCCL torch was *compiled* against and cannot tell the PyPI
wheels `2.26.2` (no Blackwell code) and `2.26.2.post1` (Blackwell code) apart. Here the runtime
version comes from `ncclGetVersion` in the `libnccl.so.2` that is loaded (or that torch will load),
the build string (`2.26.2+cuda12.8`) from that file's read-only data, and the wheel version from
the installed `nvidia-nccl-cu13` / `-cu12` / `-cu11` distribution.

The library is looked for, in order: already mapped into this process (torch loaded it), in the
`nvidia/nccl/lib` folder of an installed NCCL wheel on sys.path, then by soname through the dynamic
loader (LD_LIBRARY_PATH, ldconfig). Loading it does not initialise CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import re
import struct
import sys

SONAME = "libnccl.so.2"
WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
_BUILD_RE = re.compile(rb"NCCL version (\d+)\.(\d+)\.(\d+)([^+\x00\s]*)\+cuda(\d+)\.(\d+)")


@dataclasses.dataclass(frozen=True)
class NcclInfo:
    """What is known about this process's NCCL; any field may be None when it cannot be read."""

    version: tuple[int, int, int] | None  # from ncclGetVersion
    path: str | None  # the libnccl.so.2 asked
    source: str | None  # "loaded", "wheel" or "system"
    wheel: str | None  # e.g. "nvidia-nccl-cu12"
    wheel_version: str | None  # e.g. "2.26.2.post1"
    build_cuda: tuple[int, int] | None  # the CUDA NCCL was built with, from "NCCL version 2.26.2+cuda12.8"

    @property
    def version_text(self) -> str:
        """'2.26.2+cuda12.2' (or as much of it as is known; 'unknown' if nothing)."""
        if self.version is None:
            return "unknown"
        text = ".".join(map(str, self.version))
        return text + (f"+cuda{self.build_cuda[0]}.{self.build_cuda[1]}" if self.build_cuda else "")

    @property
    def wheel_is_loaded(self) -> bool:
        """True if the library asked is the installed wheel's (so the wheel version describes it)."""
        return self.wheel_version is not None and (
            self.path is None or os.sep.join(("nvidia", "nccl", "lib")) in self.path
        )

    def describe(self) -> str:
        """'NCCL 2.26.2+cuda12.2 (from /…/libnccl.so.2; wheel nvidia-nccl-cu12 2.26.2)'."""
        parts = [f"from {self.path}"] if self.path else ["no libnccl.so.2 found"]
        if self.wheel:
            parts.append(f"wheel {self.wheel} {self.wheel_version}")
        return f"NCCL {self.version_text} ({'; '.join(parts)})"


def nccl_info() -> NcclInfo:
    """Runtime version, library path and where it came from, wheel name and version, build CUDA."""
    path, source = find_library()
    wheel, wheel_version = _wheel()
    version = _version_of(path) if path else None
    build = build_string(path) if path else None
    build_cuda = (build[1], build[2]) if build else None
    return NcclInfo(version, path, source, wheel, wheel_version, build_cuda)


def find_library() -> tuple[str | None, str | None]:
    """(path, source) of the libnccl.so.2 this process uses or would load; (None, None) if none."""
    loaded = _mapped_nccl()
    if loaded:
        return loaded, "loaded"
    wheel_lib = _wheel_library()
    if wheel_lib:
        return wheel_lib, "wheel"
    try:
        lib = ctypes.CDLL(SONAME)
    except OSError:
        return None, None
    del lib  # the loader found it by soname; the path it mapped is now in /proc/self/maps
    return _mapped_nccl() or SONAME, "system"


def build_string(path: str) -> tuple[str, int, int] | None:
    """('2.26.2', 12, 8) from the "NCCL version 2.26.2+cuda12.8" text in the library's .rodata."""
    try:
        data = _rodata(path)
    except (OSError, ValueError, struct.error):
        return None
    m = _BUILD_RE.search(data) if data else None
    if not m:
        return None
    version = ".".join(x.decode() for x in m.group(1, 2, 3)) + m.group(4).decode("ascii", "replace")
    return version, int(m.group(5)), int(m.group(6))


def decode_version(code: int) -> tuple[int, int, int]:
    """ncclGetVersion's integer as (major, minor, patch): major*10000+minor*100+patch since 2.9, *1000 before."""
    if code >= 20900:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


@functools.lru_cache(maxsize=8)
def _version_of(path: str) -> tuple[int, int, int] | None:
    try:
        lib = ctypes.CDLL(path)
        fn = lib.ncclGetVersion
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int
    code = ctypes.c_int(0)
    if fn(ctypes.byref(code)) != 0 or code.value <= 0:
        return None
    return decode_version(code.value)


def _mapped_nccl() -> str | None:
    """The path of a libnccl.so* mapped into this process (Linux), if any."""
    with contextlib.suppress(OSError), open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        paths = (line.split(None, 5)[-1].strip() for line in maps if "libnccl.so" in line)
        return next((path for path in paths if path.startswith("/")), None)
    return None


def _wheel_library() -> str | None:
    """nvidia/nccl/lib/libnccl.so.2 in the first sys.path entry that has one, else the env's lib/ (conda)."""
    candidates = [os.path.join(entry or ".", "nvidia", "nccl", "lib", SONAME) for entry in sys.path]
    candidates.append(os.path.join(sys.prefix, "lib", SONAME))
    return next((os.path.abspath(c) for c in candidates if os.path.isfile(c)), None)


@functools.lru_cache(maxsize=1)
def _wheel() -> tuple[str | None, str | None]:
    from importlib import metadata  # ~10 ms to import; only needed here

    for name in WHEELS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None, None


@functools.lru_cache(maxsize=8)
def _rodata(path: str) -> bytes:
    """The .rodata section of an ELF64 little-endian shared object (the whole file is never read)."""
    with open(path, "rb") as f:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
        shoff = struct.unpack_from("<Q", ident, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
        _, _, _, _, str_off, str_size = sections[shstrndx]
        f.seek(str_off)
        names = f.read(str_size)
        for name_off, _, _, _, off, size in sections:
            if names[name_off : names.index(b"\x00", name_off)] == b".rodata":
                f.seek(off)
                return f.read(size)
    return b""
