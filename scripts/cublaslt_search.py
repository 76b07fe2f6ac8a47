# Times every cuBLASLt heuristic candidate for the f16 x f16 -> f32 products of a batched
# Llama-3-8B decode step (W rows x cols row-major, op T; x n x cols) against candidate 0 and
# cublasGemmEx, on the GPU host (PyTorch for buffers): python3 scripts/cublaslt_search.py 64 32
import ctypes, torch, sys
lt = ctypes.CDLL("libcublasLt.so.13")
class Heur(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("ws", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("res", ctypes.c_int * 4)]
def ok(r, what):
    if r != 0: raise RuntimeError(f"{what}: {r}")
h = ctypes.c_void_p(); ok(lt.cublasLtCreate(ctypes.byref(h)), "create")
WS = 64 << 20
ws = torch.empty(WS, dtype=torch.uint8, device="cuda")
stream = torch.cuda.current_stream().cuda_stream
cb = ctypes.CDLL("libcublas.so.13")
bh = ctypes.c_void_p(); ok(cb.cublasCreate_v2(ctypes.byref(bh)), "cublas")
ok(cb.cublasSetStream_v2(bh, ctypes.c_void_p(stream)), "stream")
def layout(ty, r, c, ld):
    l = ctypes.c_void_p(); ok(lt.cublasLtMatrixLayoutCreate(ctypes.byref(l), ty, ctypes.c_uint64(r), ctypes.c_uint64(c), ctypes.c_int64(ld)), "layout"); return l
def timed(call, reps):
    """Microseconds per call(j), j rotating over the weight copies (three calls to warm up)."""
    for j in range(3): call(j)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for j in range(reps): call(j)
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / reps
def run(name, M, K, N, reps=20):
    copies = max(2, (200 << 20) // (M * K * 2) + 1)
    Ws = [torch.randn(M, K, dtype=torch.float16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(N, K, dtype=torch.float16, device="cuda")
    out = torch.empty(N, M, dtype=torch.float32, device="cuda")
    desc = ctypes.c_void_p(); ok(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), 68, 0), "desc")
    t = ctypes.c_int(1); ok(lt.cublasLtMatmulDescSetAttribute(desc, 3, ctypes.byref(t), 4), "ta")
    n = ctypes.c_int(0); ok(lt.cublasLtMatmulDescSetAttribute(desc, 4, ctypes.byref(n), 4), "tb")
    A = layout(2, K, M, K); B = layout(2, K, N, K); C = layout(0, M, N, M)
    pref = ctypes.c_void_p(); ok(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
    wsz = ctypes.c_uint64(WS); ok(lt.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(wsz), 8), "prefws")
    res = (Heur * 64)(); cnt = ctypes.c_int()
    ok(lt.cublasLtMatmulAlgoGetHeuristic(h, desc, A, B, C, C, pref, 64, res, ctypes.byref(cnt)), "heur")
    alpha = ctypes.c_float(1.0); beta = ctypes.c_float(0.0)
    ref = (x.float() @ Ws[0].float().T)
    times = []
    for i in range(cnt.value):
        if res[i].state != 0: continue
        def go(j):
            return lt.cublasLtMatmul(h, desc, ctypes.byref(alpha), ctypes.c_void_p(Ws[j % copies].data_ptr()), A,
                ctypes.c_void_p(x.data_ptr()), B, ctypes.byref(beta), ctypes.c_void_p(out.data_ptr()), C,
                ctypes.c_void_p(out.data_ptr()), C, ctypes.byref(res[i].algo), ctypes.c_void_p(ws.data_ptr()),
                ctypes.c_size_t(WS), ctypes.c_void_p(stream))
        if go(0) != 0: continue
        torch.cuda.synchronize()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        times.append((timed(go, reps), i, res[i].ws, res[i].waves, err))
    # cublasGemmEx, CUBLAS_GEMM_DEFAULT: Kestrel's call today
    def gex(j):
        return cb.cublasGemmEx(bh, 1, 0, M, N, K, ctypes.byref(alpha), ctypes.c_void_p(Ws[j % copies].data_ptr()), 2, K,
            ctypes.c_void_p(x.data_ptr()), 2, K, ctypes.byref(beta), ctypes.c_void_p(out.data_ptr()), 0, M, 68, -1)
    ok(gex(0), "gemmex")
    gex_us = timed(gex, reps)
    base = [t for t in times if t[1] == 0]
    best = min(times)
    gb = M * K * 2 / 1e3
    print(f"{name:10} GemmEx {gex_us:.1f} us ({M*K*2/1e3/gex_us:.0f} GB/s)")
    print(f"{name:10} M={M} K={K} N={N}: {cnt.value} algos; #0 {base[0][0]:.1f} us ({gb/base[0][0]:.0f} GB/s); best #{best[1]} {best[0]:.1f} us ({gb/best[0]:.0f} GB/s, ws {best[2]>>10} KB, err {best[4]:.1e})")
    for t in sorted(times)[:4]: print(f"   #{t[1]:2} {t[0]:7.1f} us ws {t[2]>>10} KB waves {t[3]:.2f}")
for N in [int(a) for a in (sys.argv[1:] or ["64"])]:
    for name, M, K in [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate/up", 28672, 4096), ("down", 4096, 14336), ("lm head", 128256, 4096)]:
        run(name, M, K, N)
