#!/usr/bin/env python3
"""Which kernels' machine code differs between a git revision and the working tree, without a
GPU: both sources compiled to sm_90 cubins by NVRTC (the wheel kernel_check.py uses), each
kernel disassembled by nvdisasm and compared instruction by instruction (addresses, label
numbers and internal helper numbering left out). A refactor that must not touch the kernels
shows every kept kernel identical.

    python3 scripts/sass_diff.py REV      # e.g. HEAD~3 or main
"""
import ctypes, os, re, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_check as kc  # noqa: E402


def source(rev=None):
    """The kernels' source as compile.rs concatenates it, at `rev` or in the working tree."""
    def read(path):
        if rev:
            return subprocess.run(["git", "-C", kc.ROOT, "show", f"{rev}:{path}"],
                                  capture_output=True, text=True, check=True).stdout
        return open(os.path.join(kc.ROOT, path)).read()
    files = re.findall(r'include_str!\("\.\./kernels/([^"]+)"\)', read("crates/kestrel-cuda/src/compile.rs"))
    return "\n".join(read("crates/kestrel-cuda/kernels/" + f) for f in files)


def kernels(lib, src, tag):
    """{kernel: normalized SASS lines} of `src`."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kestrel.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17"]
    if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) != 0:
        sys.exit(f"NVRTC failed on {tag} (run kernel_check.py for the log)")
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    path = os.path.join(kc.TOOLS, f"sass-{tag}.cubin")
    open(path, "wb").write(buf.raw)
    nvdisasm = kc.wheel_file("nvidia-cuda-nvdisasm", "nvdisasm")
    os.chmod(nvdisasm, 0o755)
    text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    out = {}
    for part in re.split(r"\n\s*\.text\.", text)[1:]:
        name = part.split(":", 1)[0].strip()
        body = []
        for line in part.split("\n")[1:]:
            line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip()
            if not line or line.startswith(".") or line.startswith("//") or re.match(r"^[A-Za-z_$][\w$]*:$", line):
                continue
            line = re.sub(r"\.L_x_\d+", "L", line)
            body.append(re.sub(r"\$__internal_\d+_", "$__internal_N_", line))
        out[name] = body
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    lib = ctypes.CDLL(kc.wheel_file("nvidia-cuda-nvrtc", "libnvrtc.so*"))
    before = kernels(lib, source(sys.argv[1]), "before")
    now = kernels(lib, source(), "now")
    same = [k for k in now if before.get(k) == now[k]]
    differ = [k for k in now if k in before and before[k] != now[k]]
    print(f"{len(now)} kernels now, {len(before)} at {sys.argv[1]}: {len(same)} identical")
    print("differ:", " ".join(sorted(differ)) or "none")
    print("new:", " ".join(sorted(k for k in now if k not in before)) or "none")
    print("gone:", " ".join(sorted(k for k in before if k not in now)) or "none")
    sys.stdout.flush()
    os._exit(0)  # (NVRTC's library can crash at interpreter exit)


if __name__ == "__main__":
    main()
