#!/usr/bin/env bash
# On the GPU host, from the directory holding this file's copy (or dev/cuda): build the
# experiments with the host's nvcc and run them; logs go to $OUT when set.
#   bash dev/cuda/run.sh [shape] [nc stage nst ahead ...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader || true
nvcc --version | tail -1
nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/mega_gemv "$here/mega_gemv.cu" 2>"$out/ptxas.txt"
grep -E "registers|spill" "$out/ptxas.txt" | head -20 || true
/tmp/mega_gemv "$@" 2>&1 | tee "$out/mega_gemv.log"
