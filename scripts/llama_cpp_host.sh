#!/usr/bin/env bash
# llama.cpp on the GPU host, for same-call comparisons: the source the peer figures came from
# (llama-cpp-python 0.3.36's vendored copy), built with CUDA for sm_90.
#
#   scripts/llama_cpp_host.sh pack    here: download the sdist (sha256 pinned), keep what the
#                                     build needs, write .lcpp/src.tar.xz (~6 MB, git-ignored)
#   scripts/llama_cpp_host.sh build   on the GPU host (carry .lcpp, ~5 min on 16 cores): build
#                                     llama-bench, llama-batched-bench, llama-lookup and
#                                     llama-perplexity; $OUT gets lcpp.part.* (15 MB pieces)
#   scripts/llama_cpp_host.sh join    here, with the pieces in DIR ($2): join them into
#                                     .lcpp-bin/lcpp-bin.tar.xz (~23 MB; git-ignored)
#
# Then a GPU call carries .lcpp-bin and runs
#   tar xJf .lcpp-bin/lcpp-bin.tar.xz -C /tmp && LD_LIBRARY_PATH=/tmp/lcpp /tmp/lcpp/llama-bench ...
set -euo pipefail
cd "$(dirname "$0")/.."

SDIST_URL=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

pack() {
    tmp=$(mktemp -d)
    trap 'rm -rf "${tmp:-}"' EXIT
    curl -fsSL --retry 3 -o "$tmp/sdist.tar.gz" "$SDIST_URL"
    echo "$SDIST_SHA256  $tmp/sdist.tar.gz" | sha256sum -c --quiet
    tar xzf "$tmp/sdist.tar.gz" -C "$tmp"
    mv "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp" "$tmp/llama.cpp"
    # Not needed by a CUDA build of the four tools (tests are off): models, docs, tests,
    # media, Python packages, most other backends, the mobile examples (ggml-musa, -hip,
    # -rpc and pocs stay: the build that made the comparison binaries kept them).
    (cd "$tmp/llama.cpp" && rm -rf .git models docs tests media gguf-py benches \
        examples/llama.android examples/llama.swiftui examples/sycl \
        ggml/src/ggml-{vulkan,sycl,metal,opencl,cann,kompute,webgpu,zdnn,zendnn} \
        ggml/src/ggml-{hexagon,openvino,et,virtgpu})
    mkdir -p .lcpp
    tar cf - -C "$tmp" llama.cpp | xz -T0 -9 > .lcpp/src.tar.xz
    ls -la .lcpp/src.tar.xz
}

build() {
    local jobs=${JOBS:-16} out=${OUT:-/tmp}
    mkdir -p /tmp/lb && tar xJf .lcpp/src.tar.xz -C /tmp/lb
    cd /tmp/lb/llama.cpp
    cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON > /tmp/lb/cmake.log 2>&1 ||
        { tail -30 /tmp/lb/cmake.log; exit 1; }
    cmake --build build -j "$jobs" --target llama-bench llama-batched-bench llama-lookup \
        llama-perplexity > /tmp/lb/build.log 2>&1 ||
        { grep -B2 -A8 -i error /tmp/lb/build.log | head -60; exit 1; }
    cd build/bin
    strip llama-* ./*.so* 2>/dev/null || true
    rm -rf /tmp/lcpp && mkdir -p /tmp/lcpp && cp -a llama-* ./*.so* /tmp/lcpp/
    # Pieces: a file that comes back from the host is at most 16 MiB.
    cd /tmp && tar cf - lcpp | xz -T0 -9 > /tmp/lcpp-bin.tar.xz
    split -b 15M /tmp/lcpp-bin.tar.xz "$out/lcpp.part."
    sha256sum /tmp/lcpp-bin.tar.xz
}

join() {
    local dir=${1:?usage: scripts/llama_cpp_host.sh join DIR}
    mkdir -p .lcpp-bin
    cat "$dir"/lcpp.part.* > .lcpp-bin/lcpp-bin.tar.xz
    sha256sum .lcpp-bin/lcpp-bin.tar.xz
}

case "${1:-}" in
pack) pack ;;
build) build ;;
join) join "${2:-}" ;;
*)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
