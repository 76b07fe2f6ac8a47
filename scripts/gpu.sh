#!/usr/bin/env bash
# Build the release binary here (no CUDA needed), stage it in .gpu/ (git-ignored through
# .git/info/exclude), and print or run the command for the GPU host.
#
#   scripts/gpu.sh build     build + strip + copy to .gpu/kestrel
#   scripts/gpu.sh remote    the command to run on the GPU host, from the repository root
#                            (self-check, then a smoke benchmark on a synthetic Qwen2.5-1.5B)
#   scripts/gpu.sh run-here  run that command on this machine (the GPU host itself)
set -euo pipefail
cd "$(dirname "$0")/.."

remote_cmd() {
    cat <<'CMD'
set -e
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export KESTREL_HOME=${KESTREL_HOME:-/tmp/kestrel-home}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
.gpu/kestrel gpu-check
.gpu/kestrel synth --arch qwen2 --preset qwen2.5-1.5b --type q4_k_m -o /tmp/q.gguf
.gpu/kestrel gpu-check --bench /tmp/q.gguf
CMD
}

case "${1:-build}" in
build)
    cargo build --release -p kestrel-cli
    mkdir -p .gpu
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qx "/.gpu/" "$exclude" 2>/dev/null || echo "/.gpu/" >> "$exclude"
    cp target/release/kestrel .gpu/kestrel
    strip .gpu/kestrel
    ls -l .gpu/kestrel
    echo "on the GPU host, from the repository root:"
    remote_cmd
    ;;
remote) remote_cmd ;;
run-here) bash -c "$(remote_cmd)" ;;
*)
    echo "usage: $0 [build|remote|run-here]" >&2
    exit 2
    ;;
esac
