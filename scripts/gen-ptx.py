#!/usr/bin/env python3
"""Compiles crates/kv-device/src/cuda/copy_rows.cu to PTX with NVRTC (no GPU needed).

Usage: gen-ptx.py LIBNVRTC_SO SRC.cu OUT.ptx [ARCH]   (ARCH default compute_80)
scripts/gpu-build.sh --regen-ptx installs NVRTC from PyPI and calls this.
"""
import ctypes, sys

lib = ctypes.CDLL(sys.argv[1])
src = open(sys.argv[2], "rb").read()
out = sys.argv[3]
arch = sys.argv[4] if len(sys.argv) > 4 else "compute_80"
prog = ctypes.c_void_p()
def check(r, what):
    if r != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise SystemExit(f"{what}: {lib.nvrtcGetErrorString(r).decode()}")
check(lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"copy_rows.cu", 0, None, None), "create")
opts = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
arr = (ctypes.c_char_p * len(opts))(*opts)
r = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
if log.value.strip():
    print(log.value.decode(), file=sys.stderr)
check(r, "compile")
lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
ptx = ctypes.create_string_buffer(n.value)
check(lib.nvrtcGetPTX(prog, ptx), "get ptx")
open(out, "w").write(ptx.value.decode())
major, minor = ctypes.c_int(), ctypes.c_int()
lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
print(f"wrote {out} ({len(ptx.value)} bytes, NVRTC {major.value}.{minor.value}, {arch})")
