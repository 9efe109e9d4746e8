"""Compile the decode kernel for a StepLayout, with or without a GPU (CUTE_DSL_ARCH=sm_90a), and
read back what the compiler made of it: PTX, cubin, SASS, registers, spills."""

from __future__ import annotations

import functools
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass

# Before cutlass is first imported (by .interpreter): it reads the target at import. Without a GPU it
# would otherwise pick its own default; the megakernel is built for Hopper.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from ..instructions.layout import StepLayout  # noqa: E402
from .interpreter import ARG_NAMES, DecodeKernel, KernelOptions  # noqa: E402


@dataclass(frozen=True)
class KernelKey:
    layout: StepLayout
    lm_tiles: int
    num_counters: int
    max_queue_len: int
    kv_strides: tuple[int, int, int] | None
    options: KernelOptions


def device_code(layout: StepLayout, program, options: KernelOptions = KernelOptions()) -> DecodeKernel:
    """The DecodeKernel the engine compiles for `program` (its trace-time decisions: slot geometry, ring depth,
    consumer warps, row groups), built on the CPU without compiling; the queues as the default policy lays them."""
    from ..instructions.record import serialize
    from ..schedule import assign

    table, _ = serialize(assign(program, "balanced"))
    return DecodeKernel(layout, program.lm_tiles, program.num_counters, table.shape[1], None, options)


@functools.lru_cache(maxsize=16)
def compile_decode_kernel(key: KernelKey, keep_artifacts: bool = False):
    """-> compiled callable taking (*addresses in ARG_NAMES order, stream). Cached per key."""
    import cutlass.cute as cute
    from cutlass import Int64
    from cutlass.cute.runtime import make_fake_stream

    kernel = DecodeKernel(key.layout, key.lm_tiles, key.num_counters, key.max_queue_len, key.kv_strides,
                          key.options)
    args = [Int64(0)] * len(ARG_NAMES)
    options = "--keep-ptx --keep-cubin" if keep_artifacts else ""
    return cute.compile(kernel, *args, make_fake_stream(), options=options)


def nvdisasm_path() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-nvdisasm wheel installs bin/ under the nvidia namespace
        for base in nvidia.__path__:
            for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
                p = os.path.join(base, sub)
                if os.path.exists(p):
                    return p
    except ImportError:
        pass
    return None


def sass(cubin: bytes) -> str:
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack frame and code size of the kernel in an sm_90 cubin, read from the ELF
    (.text section info and the .nv.info attributes), so no GPU or cuobjdump is needed."""
    e_shoff, = struct.unpack_from("<Q", cubin, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = []
    for i in range(e_shnum):
        name, typ, flags, addr, off, size, link, info, align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", cubin, e_shoff + i * e_shentsize)
        secs.append((name, off, size, info))
    stroff = secs[e_shstrndx][1]

    def secname(n: int) -> str:
        return cubin[stroff + n: cubin.index(b"\0", stroff + n)].decode()

    out: dict[str, int] = {"frame_bytes": 0}
    for name, off, size, info in secs:
        s = secname(name)
        if s.startswith(".text."):
            out["code_bytes"] = size
        if s.startswith(".nv.info"):
            p, end = off, off + size
            while p < end:
                fmt, attr = cubin[p], cubin[p + 1]
                p += 2
                if fmt == 0x04:            # attribute with a 16-bit length and a payload
                    ln, = struct.unpack_from("<H", cubin, p)
                    p += 2
                    if ln == 8 and attr in (0x2F, 0x11):   # REGCOUNT, FRAME_SIZE: (symbol, value)
                        _, v = struct.unpack_from("<II", cubin, p)
                        out["regs" if attr == 0x2F else "frame_bytes"] = v
                    p += ln
                elif fmt == 0x03:          # 16-bit value
                    p += 2
                elif fmt == 0x02:          # 8-bit value
                    p += 1
    return out


def spill_instructions(sass_text: str) -> int:
    """Local-memory loads and stores in SASS (register spills or stack arrays)."""
    return len(re.findall(r"\b(?:LDL|STL)\b", sass_text))
