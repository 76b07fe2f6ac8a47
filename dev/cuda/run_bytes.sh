#!/usr/bin/env bash
# On the GPU host, from the directory holding this file's copy (or dev/cuda): build
# mega_bytes.cu with the host's nvcc and run every shape x format (one process each, so a
# trap in one does not lose the others); logs go to $OUT when set.
#   bash dev/cuda/run_bytes.sh [extra variant args for every run: stage nst ahead wmode xmode ...]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader || true
nvcc --version | tail -1
nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/mega_bytes "$here/mega_bytes.cu" 2>"$out/ptxas_bytes.txt" || { cat "$out/ptxas_bytes.txt"; exit 1; }
rc=0
for shape in qwen llama; do
  for fmt in f16 q8; do
    timeout 60 /tmp/mega_bytes $shape $fmt "$@" 2>&1 | tee "$out/bytes-$shape-$fmt.log"
    r=${PIPESTATUS[0]}; echo "exit $shape $fmt: $r"; [ $r -eq 0 ] || rc=1
  done
done
exit $rc
