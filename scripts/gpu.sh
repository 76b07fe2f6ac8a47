#!/usr/bin/env bash
# Build the release binary here (no CUDA needed), stage it in .gpu/ (git-ignored through
# .git/info/exclude), and print or run the command for the GPU host.
#
#   scripts/gpu.sh build     build + strip + copy to .gpu/kestrel, and the kernels' sm_90 cubin
#                            (scripts/kernel_check.py --cubin) into .gpu/cuda-cache, which the
#                            commands below put in the backend's disk cache: the GPU host then
#                            compiles nothing (~100 s a fresh host saves)
#   scripts/gpu.sh remote    the command to run on the GPU host, from the repository root
#                            (self-check, then a smoke benchmark on a synthetic Qwen2.5-1.5B)
#   scripts/gpu.sh run-here  run that command on this machine (the GPU host itself)
#   scripts/gpu.sh bench     on the GPU host: the peer-table benchmarks (synthetic models of
#                            llama.cpp's shapes, `kestrel bench --device cuda -p 512 -n 128`)
#   scripts/gpu.sh serve-profile  on the GPU host: the server at 64 clients with every kernel
#                            timed (per-kernel table when it stops)
#   scripts/gpu.sh verify    on the GPU host: gpu-check, then `bench --seqs 4,8` on synthetic
#                            Llama-3-8B Q4_K_M and Q4_0 (the small-batch routing by format)
#   scripts/gpu.sh decode-ab on the GPU host: tg128 of synthetic Qwen2.5-1.5B and Llama-3-8B
#                            Q4_K_M (and `--seqs $SEQS` if set) under each set of $AB (another
#                            build: `BIN=.gpu/kestrel-base`, or operational env settings)
#   scripts/gpu.sh build-base  build revision ${BASE:-HEAD} as .gpu/kestrel-${NAME:-base} (after `build`:
#                            it adds its cubin to .gpu/cuda-cache) for `AB="BIN=.gpu/kestrel-base -"`
#   scripts/gpu.sh sampled   on the GPU host: `kestrel serve` at 64 clients, greedy and sampled
#                            (temperature 1; llama.cpp's defaults), for each binary of $BINS
#   scripts/gpu.sh ceilings  on the GPU host: ncu durations and DRAM bytes of each launch of
#                            8-layer Llama-3-8B models (${TYPES:-q4_k_m q8_0}; scripts/ncu_launches.py)
#   scripts/gpu.sh verify-ab on the GPU host: gpu-check --verification, then `bench --verify`
#                            step costs (1..8 tokens) of ${BINS:-.gpu/kestrel-base .gpu/kestrel}
#   scripts/gpu.sh kv-serve  on the GPU host: `kestrel serve --ctx 8192`, 64 clients, 4,096-token
#                            prompts, f16 and q8_0 K/V in the same --kv-memory (${KV_MEMORY:-8GiB}):
#                            running sequences (max, mean) from /metrics and generated tok/s
#   scripts/gpu.sh batched   on the GPU host: `kestrel bench --seqs ${SEQS:-1,8,32,64}` (llama-batched-
#                            bench's table) and `kestrel serve` under `kestrel bench-serve` at
#                            concurrency 1 and 64 (512 + 128 tokens), synthetic Llama-3-8B Q4_K_M
set -euo pipefail
cd "$(dirname "$0")/.."

remote_cmd() {
    cat <<'CMD'
set -e
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export KESTREL_HOME=${KESTREL_HOME:-/tmp/kestrel-home}
mkdir -p "$KESTREL_HOME/cuda-cache" && cp .gpu/cuda-cache/*.cubin "$KESTREL_HOME/cuda-cache/" 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
.gpu/kestrel gpu-check
.gpu/kestrel synth --arch qwen2 --preset qwen2.5-1.5b --type q4_k_m -o /tmp/q.gguf
.gpu/kestrel gpu-check --bench /tmp/q.gguf
CMD
}

# Environment of the commands run on the GPU host.
gpu_env() {
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
    export KESTREL_HOME=${KESTREL_HOME:-/tmp/kestrel-home}
    mkdir -p "$KESTREL_HOME/cuda-cache"
    cp .gpu/cuda-cache/*.cubin "$KESTREL_HOME/cuda-cache/" 2>/dev/null || true
}

# The peer table's models (`synth` arch, preset, type).
PEER_MODELS=("qwen2 qwen2.5-1.5b q4_k_m" "llama llama3-8b q4_k_m" "llama llama3-8b q4_0"
    "llama llama3-8b q8_0" "llama llama3-8b f16")

# `peer_model ARCH PRESET TYPE`: prints the synthetic model's path, made first if missing
# (kept in /tmp: a warm host reuses it on the next call).
peer_model() {
    local f=/tmp/$2-$3.gguf
    [ -f "$f" ] || .gpu/kestrel synth --arch "$1" --preset "$2" --type "$3" -o "$f" >/dev/null
    echo "$f"
}

# Synthetic Llama-3-8B Q4_K_M; prints its path.
llama3_8b() {
    peer_model llama llama3-8b q4_k_m
}

# `serve_start PORT LOG [VAR=VALUE ...]`: the server the batched runs use, on MODEL, in the
# background (its pid in $server); returns once it answers.
serve_start() {
    local port=$1 log=$2
    shift 2
    env "$@" "${BIN:-.gpu/kestrel}" serve -m "$model" --device cuda --max-seqs 64 --ctx 700 \
        --batch 2048 --max-prefill 1024 --port "$port" 2>"$log" &
    server=$!
    for _ in $(seq 120); do
        .gpu/kestrel bench-serve --url "http://127.0.0.1:$port" --concurrency 1 --requests 1 \
            --prompt-len 8 --gen-len 1 >/dev/null 2>&1 && break
        sleep 1
    done
}

# Where the scheduler's time went (forward steps vs its own work), from /metrics.
scheduler_time() {
    curl -s "http://127.0.0.1:$1/metrics" |
        grep -E '^kestrel_(scheduler_seconds|steps|tokens_evaluated)' || true
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
    python3 scripts/kernel_check.py --cubin .gpu/cuda-cache ||
        echo "no cubin made here: the GPU host will compile the kernels (~100 s)" >&2
    echo "on the GPU host, from the repository root:"
    remote_cmd
    ;;
build-base)
    # The build of git revision ${BASE:-HEAD} as .gpu/kestrel-${NAME:-base}, its cubin kept beside the
    # current one in .gpu/cuda-cache (the cache is keyed by source): `AB="BIN=.gpu/kestrel-base -"`
    # then compares the two builds in one decode-ab call.
    rm -rf .gpu/base-tree
    git worktree add -f --detach .gpu/base-tree "${BASE:-HEAD}" >/dev/null
    (cd .gpu/base-tree && CARGO_TARGET_DIR=../../target/base cargo build --release -p kestrel-cli &&
        python3 scripts/kernel_check.py --cubin ../base-cubin)
    cp target/base/release/kestrel ".gpu/kestrel-${NAME:-base}"
    strip ".gpu/kestrel-${NAME:-base}"
    cp .gpu/base-cubin/*.cubin .gpu/cuda-cache/
    rm -rf .gpu/base-cubin
    git worktree remove --force .gpu/base-tree
    ls -l .gpu .gpu/cuda-cache
    ;;
remote) remote_cmd ;;
bench)
    gpu_env
    out=${OUT:-/tmp}
    for spec in "${PEER_MODELS[@]}"; do
        set -- $spec
        f=$(peer_model "$@")
        .gpu/kestrel bench -m "$f" --device cuda -p 512 -n 128 -r 3 --json > "$out/bench-$2-$3.json"
        echo "$2 $3: $(grep -E '"(n_prompt|n_gen|avg_ts|stddev_ts|achieved_gb_s)"' "$out/bench-$2-$3.json" | tr -d ' \n')"
    done
    ;;
ceilings)
    # Each launch's duration and DRAM bytes under ncu (caches flushed, no launch latency).
    gpu_env
    out=${OUT:-/tmp}
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    metrics=gpu__time_duration.sum,dram__bytes_read.sum
    for t in ${TYPES:-q4_k_m q8_0}; do
        f=/tmp/l8-$t.gguf
        [ -f "$f" ] || .gpu/kestrel synth --arch llama --preset llama3-8b --type "$t" --layers 8 \
            -o "$f" >/dev/null
        KESTREL_CUDA_GRAPHS=0 "$ncu" --clock-control none --csv --metrics $metrics \
            --launch-skip 300 --launch-count 60 .gpu/kestrel bench -m "$f" --device cuda \
            -p 0 -n 4 -r 1 >"$out/ncu-$t.csv" 2>&1
        echo "== $t"
        python3 scripts/ncu_launches.py kernels "$out/ncu-$t.csv"
    done
    ;;
batched)
    gpu_env
    model=$(llama3_8b)
    .gpu/kestrel bench -m "$model" --device cuda --seqs "${SEQS:-1,8,32,64}" -p 512 -n 128 -r 1
    serve_start 8099 /tmp/serve.log
    .gpu/kestrel bench-serve --url http://127.0.0.1:8099 --concurrency 1,64 --requests 64 \
        --prompt-len 512 --gen-len 128 || true
    scheduler_time 8099 # over both runs
    kill "$server"
    wait "$server" 2>/dev/null || true
    tail -3 /tmp/serve.log
    ;;
verify)
    gpu_env
    peer_model llama llama3-8b q4_0 >/dev/null &
    q4_0=/tmp/llama3-8b-q4_0.gguf
    .gpu/kestrel gpu-check | grep -vE " ok$"
    model=$(llama3_8b)
    wait
    for m in "$model" "$q4_0"; do
        .gpu/kestrel bench -m "$m" --device cuda --seqs 4,8 -p 512 -n 128 -r 1
    done
    ;;
sampled)
    # The server at 64 clients: greedy, temperature 1 alone (OpenAI's default), with top-p
    # 0.95, and llama.cpp's CLI defaults (t 0.8, top-k 40, top-p 0.95, min-p 0.05); each binary of
    # ${BINS:-.gpu/kestrel} in turn (A/B in one call), with the decode steps' mean time.
    gpu_env
    model=$(llama3_8b)
    for bin in ${BINS:-.gpu/kestrel}; do
        for sampling in ${SAMPLINGS:-"--temperature 0" "--temperature 1" "--temperature 1 --top-p 0.95" \
            "--temperature 0.8 --top-k 40 --top-p 0.95 --min-p 0.05"}; do
            echo "== $bin $sampling"
            BIN=$bin serve_start 8097 /tmp/serve-sampled.log KESTREL_STEP_LOG=1
            .gpu/kestrel bench-serve --url http://127.0.0.1:8097 --concurrency 64 --requests 64 \
                --prompt-len 512 --gen-len 128 $sampling | grep -E '^ *(conc|64) ' || true
            kill "$server"
            wait "$server" 2>/dev/null || true
            grep -E '^step .* seqs 64 prefill_tokens 0 ' /tmp/serve-sampled.log |
                awk '{s += $9; n++} END {if (n) printf "decode steps of 64: %d, mean %.0f us\n", n, s / n}'
        done
    done
    ;;
serve-profile)
    # The server at 64 clients with one log line per step (KESTREL_STEP_LOG=1), summed by
    # step kind: decode-only steps vs steps carrying prompt tokens.
    gpu_env
    model=$(llama3_8b)
    serve_start 8098 /tmp/serve-profile.log KESTREL_STEP_LOG=1
    .gpu/kestrel bench-serve --url http://127.0.0.1:8098 --concurrency 64 --requests 64 \
        --prompt-len 512 --gen-len 128 || true
    scheduler_time 8098
    kill -INT "$server"
    wait "$server" 2>/dev/null || true
    grep '^step ' /tmp/serve-profile.log | awk '{k = ($7 > 0) ? "with-prompt" : "decode-only";
        n[k]++; t[k] += $9; tok[k] += $3; s[k] += $5}
        END {for (k in n) printf "%s steps %d, forward %.3f s, %.2f ms/step, %.1f tokens/step, %.1f seqs/step\n",
            k, n[k], t[k] / 1e6, t[k] / n[k] / 1e3, tok[k] / n[k], s[k] / n[k]}'
    grep '^step ' /tmp/serve-profile.log | tail -3
    ;;
decode-ab)
    # Single-token decode (tg128) and `--seqs $SEQS` under each setting of $AB (space-
    # separated VAR=VALUE[,VAR=VALUE] sets; "-" for the defaults), on synthetic Qwen2.5-1.5B
    # and Llama-3-8B Q4_K_M: A/B comparisons of builds (BIN=...) in one call.
    gpu_env
    qwen=$(peer_model qwen2 qwen2.5-1.5b q4_k_m)
    model=$(llama3_8b)
    for set in ${AB:--}; do
        vars=() bin=.gpu/kestrel
        [ "$set" = - ] || IFS=, read -ra vars <<<"$set"
        # BIN=path in a set runs another build (e.g. .gpu/kestrel-base: see `build-base`)
        for i in "${!vars[@]}"; do
            case ${vars[$i]} in BIN=*) bin=${vars[$i]#BIN=}; unset "vars[$i]" ;; esac
        done
        for m in "$qwen" "$model"; do
            echo "$set $(basename "$m"): $(env "${vars[@]}" "$bin" bench -m "$m" --device cuda \
                -p 0 -n 128 -r 3 | grep -oE 'tg128 \| [0-9.]+ ± [0-9.]+')"
        done
        [ -z "${SEQS:-}" ] || env "${vars[@]}" "$bin" bench -m "$model" --device cuda \
            --seqs "$SEQS" -p 512 -n 128 -r 1 | grep -E '^\|' | tail -n +3
    done
    ;;
verify-ab)
    # Speculative verification (#26): gpu-check --verification (products of 2..=8 tokens and
    # invariant steps bit-identical to single-token ones), then `bench --verify` step costs
    # on synthetic Qwen2.5-1.5B Q4_K_M for each binary of ${BINS:-.gpu/kestrel-base .gpu/kestrel},
    # alternated over two rounds (see `build-base`).
    gpu_env
    qwen=$(peer_model qwen2 qwen2.5-1.5b q4_k_m)
    .gpu/kestrel gpu-check --verification | grep -E 'FAIL|ERROR|checks? (passed|failed)' || true
    for round in 1 2; do
        for bin in ${BINS:-.gpu/kestrel-base .gpu/kestrel}; do
            echo "$bin, round $round:"
            "$bin" bench -m "$qwen" --device cuda --verify 1,2,3,5,8 -n 96 -d 384 -r 3 | grep -E '^\| [0-9]'
        done
    done
    ;;
kv-serve)
    # #27's serve target: `kestrel serve --ctx 8192` under 64 clients with 4,096-token prompts
    # (random ids, 128 generated), f16 then q8_0 K/V in the same --kv-memory (${KV_MEMORY:-8GiB}:
    # ~15 f16 sequences of 4,224 tokens on Llama-3-8B); /metrics' running sequences sampled
    # every 0.2 s (max and mean), the generated tokens/s from bench-serve.
    gpu_env
    model=/tmp/llama3-8b-q4_k_m-64k.gguf
    [ -f "$model" ] || .gpu/kestrel synth --arch llama --preset llama3-8b --type q4_k_m \
        --ctx 65536 -o "$model" >/dev/null
    for t in ${KV_TYPES:-f16 q8_0}; do
        .gpu/kestrel serve -m "$model" --device cuda --ctx 8192 --max-seqs 64 \
            --kv-memory "${KV_MEMORY:-8GiB}" -ctk "$t" -ctv "$t" --batch 2048 --max-prefill 1024 \
            --port 8096 2>"/tmp/serve-kv-$t.log" &
        server=$!
        for _ in $(seq 120); do
            curl -sf http://127.0.0.1:8096/health | grep -q '"ok"' && break
            sleep 1
        done
        (while kill -0 "$server" 2>/dev/null; do
            curl -s http://127.0.0.1:8096/metrics | awk '/^kestrel_running_sequences /{print $2}'
            sleep 0.2
        done) >"/tmp/running-$t.txt" &
        sampler=$!
        echo "== $t K/V, --kv-memory ${KV_MEMORY:-8GiB}"
        .gpu/kestrel bench-serve --url http://127.0.0.1:8096 --concurrency 64 --requests 64 \
            --prompt-len 4096 --gen-len 128 || true
        curl -s http://127.0.0.1:8096/metrics |
            grep -E '^kestrel_(kv_blocks_total|kv_cache_bytes_per_token|preemptions_total) ' || true
        kill "$server"
        wait "$server" 2>/dev/null || true
        kill "$sampler" 2>/dev/null || true
        awk '$1 > 0 {n++; s += $1; if ($1 > m) m = $1}
            END {if (n) printf "running sequences: max %d, mean %.1f (%d samples)\n", m, s / n, n}' \
            "/tmp/running-$t.txt"
    done
    ;;
run-here) bash -c "$(remote_cmd)" ;;
*)
    echo "usage: $0 [build|build-base|remote|run-here|bench|verify|decode-ab|batched|serve-profile|sampled|ceilings|kv-serve]" >&2
    exit 2
    ;;
esac
