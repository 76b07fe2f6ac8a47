#!/usr/bin/env bash
# Full test run: Python test oracles, both real models in the cache, then every crate's tests.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q -r requirements-test.txt

# Pull the real models first so that a download problem is reported as such, not as a
# failing test. Already-cached, verified models make this a no-op.
for model in qwen2.5-coder-1.5b gemma-3-270m; do
    echo "== kestrel pull $model"
    if ! cargo run --release -q -p kestrel-cli -- pull "$model"; then
        echo "scripts/test.sh: could not download the model '$model' (see the error above);" >&2
        echo "the tests need it in \${KESTREL_HOME:-~/.cache/kestrel}/models." >&2
        exit 1
    fi
done

cargo test --release --workspace
