//! cuBLAS products of f16 operands: `cublasGemmEx` with its heuristic's first algorithm.
//! (Timing cuBLASLt's candidates per shape was tried and not kept: `bench --seqs 64` +2.5%
//! in one call and nothing in another, the server at 64 clients −8 to −18% from each new
//! shape's first step; git history has it.)

/// One product shape: rows × cols weights (row-major f16) times n tokens, outputs with
/// leading dimension ld.
#[derive(Clone, Copy, Hash, PartialEq, Eq, Debug)]
pub struct Shape {
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub ld: usize,
}

/// `cublasGemmEx`: out (n × ld, column-major rows × n) = aᵀ · x (+ out with accumulate).
pub fn gemm_ex_raw(
    blas: &cudarc::cublas::CudaBlas,
    s: Shape,
    a: u64,
    x: u64,
    out: u64,
    accumulate: bool,
) -> anyhow::Result<()> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
    };
    let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
    // SAFETY: a, x and out hold rows×cols, n×cols and n×ld elements (checked by the
    // callers); the handle is bound to the backend's stream.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            s.rows as i32,
            s.n as i32,
            s.cols as i32,
            (&alpha as *const f32).cast(),
            a as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16F,
            s.cols as i32,
            x as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16F,
            s.cols as i32,
            (&beta as *const f32).cast(),
            out as *mut std::ffi::c_void,
            cudaDataType::CUDA_R_32F,
            s.ld as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| anyhow::anyhow!("{e:?}"))
}
