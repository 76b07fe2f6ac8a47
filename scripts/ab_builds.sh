#!/usr/bin/env bash
# On the GPU host: an A/B of two builds in one call. gpu-check of the new build, the start
# time of a fresh process, then $ROUNDS alternated rounds of tg128 / pp512 (synthetic
# Qwen2.5-1.5B and Llama-3-8B Q4_K_M) and `--seqs 8,64`, and the tiny synthetic model of
# every architecture scored on the CPU and the GPU (the same token ids).
#
#   scripts/gpu.sh build; BASE=<rev> NAME=base scripts/gpu.sh build-base   # here
#   bash scripts/ab_builds.sh                                               # on the GPU host
#
# NEW (default .gpu/kestrel) and BASE (default .gpu/kestrel-base) name the binaries; CHECK=0
# skips gpu-check. gpu-check's log goes to $OUT (or /tmp).
set -u
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export KESTREL_HOME=${KESTREL_HOME:-/tmp/kestrel-home}
mkdir -p "$KESTREL_HOME/cuda-cache"
cp .gpu/cuda-cache/*.cubin "$KESTREL_HOME/cuda-cache/" 2>/dev/null || true
NEW=${NEW:-.gpu/kestrel} BASE=${BASE:-.gpu/kestrel-base} out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
q=/tmp/qwen2.5-1.5b-q4_k_m.gguf l=/tmp/llama3-8b-q4_k_m.gguf
[ -f $q ] || $BASE synth --arch qwen2 --preset qwen2.5-1.5b --type q4_k_m -o $q >/dev/null &
[ -f $l ] || $BASE synth --arch llama --preset llama3-8b --type q4_k_m -o $l >/dev/null &
if [ "${CHECK:-1}" = 1 ]; then
    $NEW gpu-check >"$out/gpucheck.log" 2>&1
    echo "gpu-check rc=$? ok=$(grep -c ' ok$' "$out/gpucheck.log")"
    grep -v ' ok$' "$out/gpucheck.log" | head -20
fi
wait
TIMEFORMAT='%R s'
for b in $BASE $NEW $BASE $NEW; do
    echo -n "start $b: "
    { time $b bench -m $q --device cuda -p 16 -n 1 -r 1 >/dev/null 2>&1; } 2>&1
done
for round in $(seq "${ROUNDS:-3}"); do
    for b in $BASE $NEW; do
        echo "== round $round $b"
        $b bench -m $q --device cuda -p 512 -n 128 -r 5 2>&1 | grep -E 'pp512|tg128'
        $b bench -m $l --device cuda -p 512 -n 128 -r 3 2>&1 | grep -E 'pp512|tg128'
        $b bench -m $l --device cuda --seqs 8,64 -p 512 -n 128 -r 1 2>&1 | tail -2
    done
done
echo "== tiny synthetic models, CPU vs CUDA perplexity of the same ids"
python3 -c "import random; print(list(random.Random(1).randrange(0, 250) for _ in range(64)))" >/tmp/ids64.json
for a in llama qwen3 gemma3 phi3 mistral3 qwen3moe gpt-oss; do
    $NEW synth --arch $a --preset tiny --type q8_0 -o /tmp/tiny-$a.gguf >/dev/null 2>&1 || echo "synth $a failed"
    for d in cpu cuda; do
        echo "$a $d: $($NEW perplexity -m /tmp/tiny-$a.gguf --device $d --ids /tmp/ids64.json -c 32 2>&1 | tail -1)"
    done
done
