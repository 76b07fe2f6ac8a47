#!/usr/bin/env python3
"""Compile the CUDA kernels on a machine without a GPU: NVRTC from the nvidia-cuda-nvrtc
wheel (PTX for sm_90, same source order and options as crates/kestrel-cuda/src/compile.rs),
then ptxas from the nvidia-cuda-nvcc wheel for per-kernel registers and spills.

    python3 scripts/kernel_check.py            # compile errors, then one line per kernel
    python3 scripts/kernel_check.py gemv_dec   # only kernels whose name contains this
    python3 scripts/kernel_check.py --cubin DIR  # the sm_90 cubin, named as the backend's
                                                 # disk cache names it (see gpu.sh build)
    python3 scripts/kernel_check.py --loops gemv_q8  # the SASS loops of one kernel: their
                                                     # instruction counts and mix
    python3 scripts/kernel_check.py --loops gemv_q8 .L_x_12  # one loop with source lines

The wheels are downloaded once into ~/.cache/kestrel/cuda-tools (pip download, no install).
"""
import ctypes, glob, os, re, subprocess, sys, zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.expanduser("~/.cache/kestrel/cuda-tools")


def wheel_file(package, pattern):
    hits = glob.glob(os.path.join(TOOLS, "**", pattern), recursive=True)
    if hits:
        return hits[0]
    os.makedirs(TOOLS, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", TOOLS, package], check=True)
    for whl in glob.glob(os.path.join(TOOLS, "*.whl")):
        zipfile.ZipFile(whl).extractall(TOOLS)
    hits = glob.glob(os.path.join(TOOLS, "**", pattern), recursive=True)
    if not hits:
        sys.exit(f"{pattern} not found in the {package} wheel")
    return hits[0]


def compile_cubin(lib, src, out_dir):
    """The cubin for sm_90 under the name compile.rs's cache_path gives it."""
    import hashlib
    arch = "sm_90"
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kestrel.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) != 0:
        sys.exit("NVRTC failed (run without --cubin for the log)")
    n = ctypes.c_size_t()
    assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)) == 0
    buf = ctypes.create_string_buffer(n.value)
    assert lib.nvrtcGetCUBIN(prog, buf) == 0
    key = hashlib.sha256(src.encode() + b"\0" + arch.encode()).digest()[:12].hex()
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, f"kestrel-{arch}-*.cubin")):
        os.remove(old)
    path = os.path.join(out_dir, f"kestrel-{arch}-{key}.cubin")
    open(path, "wb").write(buf.raw)
    print(path, n.value, "bytes")


def sass_loops(lib, src, kernel, show=None):
    """Compile with line info, disassemble one kernel (nvdisasm from its wheel) and print
    each backward branch's loop: instruction count, global / shared loads, dp4a, and the
    source lines most of it comes from. With `show`, that loop instruction by instruction."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kestrel.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-lineinfo"]
    if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) != 0:
        sys.exit("NVRTC failed (run without --loops for the log)")
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    cubin = os.path.join(TOOLS, "lineinfo.cubin")
    open(cubin, "wb").write(buf.raw)
    nvdisasm = wheel_file("nvidia-cuda-nvdisasm", "nvdisasm")
    os.chmod(nvdisasm, 0o755)
    text = subprocess.run([nvdisasm, "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    start = text.find(f".text.{kernel}:")
    if start < 0:
        sys.exit(f"no kernel {kernel}")
    end = text.find("\n.text.", start + 1)
    labels, ins, line = {}, [], None
    for l in text[start:end if end > 0 else None].split("\n"):
        m = re.match(r"^\s*(\.L_x_\d+):", l)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.search(r"line (\d+)", l)
        if m:
            line = int(m.group(1))
            continue
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", l)
        if m:
            ins.append((m.group(1).strip(), line))
    lines = src.split("\n")
    for i, (t, _) in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\(|)(\.L_x_\d+)", t)
        if not m or labels.get(m.group(1), i + 1) > i:
            continue
        body = ins[labels[m.group(1)]:i + 1]
        count = lambda op: sum(op in b[0] for b in body)
        if show is None:
            top = {}
            for _, s in body:
                top[s] = top.get(s, 0) + 1
            where = ", ".join(f"{s}" for s, _ in sorted(top.items(), key=lambda kv: -kv[1])[:4])
            print(f"{m.group(1):<10} {len(body):>5} instr  LDG {count('LDG'):>3}  LDS {count('LDS'):>3}"
                  f"  IDP {count('IDP'):>3}  FFMA {count('FFMA'):>3}  lines {where}")
        elif m.group(1) == show:
            for t2, s in body:
                print(f"{s or 0:>5} {t2:<60} | {lines[s - 1].strip()[:70] if s else ''}")


def main():
    src_files = re.findall(r'include_str!\("\.\./kernels/([^"]+)"\)',
                           open(os.path.join(ROOT, "crates/kestrel-cuda/src/compile.rs")).read())
    src = "\n".join(open(os.path.join(ROOT, "crates/kestrel-cuda/kernels", f)).read() for f in src_files)
    lib = ctypes.CDLL(wheel_file("nvidia-cuda-nvrtc", "libnvrtc.so*"))
    if len(sys.argv) > 2 and sys.argv[1] == "--loops":
        sass_loops(lib, src, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
        sys.stdout.flush()
        os._exit(0)  # (NVRTC's library can crash at interpreter exit)
    if len(sys.argv) > 2 and sys.argv[1] == "--cubin":
        return compile_cubin(lib, src, sys.argv[2])
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kestrel.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=compute_90", b"--std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode())
    if rc != 0:
        sys.exit(f"NVRTC failed ({rc})")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    ptx_path = os.path.join(TOOLS, "kestrel.ptx")
    open(ptx_path, "w").write(ptx.value.decode())
    ptxas = wheel_file("nvidia-cuda-nvcc", "ptxas")
    os.chmod(ptxas, 0o755)
    out = subprocess.run([ptxas, "-arch=sm_90", "-v", ptx_path, "-o", os.devnull],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr)
    want = sys.argv[1] if len(sys.argv) > 1 else ""
    name = None
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and name and want in name:
            spill = re.search(r"(\d+) bytes spill stores", prev) if prev else None
            print(f"{name:<24} {m.group(1):>4} registers  {spill.group(0) if spill else ''}")
        prev = line


if __name__ == "__main__":
    prev = None
    main()
