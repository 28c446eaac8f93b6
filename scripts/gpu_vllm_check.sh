#!/usr/bin/env bash
# End-to-end check of kvtier's vLLM connector on a CUDA machine (needs network to PyPI).
#
# Usage: scripts/gpu_vllm_check.sh [MODEL_DIR]
#
# 1. Creates (or reuses) a venv with vllm==0.33.0 (CUDA build) and kvtier (pip -e).
# 2. Uses MODEL_DIR, or saves a small random Llama with transformers (no hub download).
# 3. Runs the same multi-turn chat workload through vLLM's offline LLM API twice, each in
#    its own process: without a connector, and with KVTierConnector (CPU tier). The GPU
#    KV pool is kept small, so a conversation's history is evicted from the GPU before
#    its next turn and comes back from kvtier's tier (or is recomputed without it).
# 4. Reports time to first token per turn and the exact match of every greedy output;
#    exits non-zero if outputs differ, if kvtier served no hit, or if a run failed.
#
# Settings (environment): KVTIER_GPU_CHECK_VENV (venv path, default .venv-vllm-gpu),
# KVTIER_GPU_CHECK_DIR (work dir, default a fresh temp dir), PYTHON (default python3),
# KVTIER_BATCH_INVARIANT (default 1: VLLM_BATCH_INVARIANT=1, so recomputed and loaded KV
# are bitwise equal and outputs must match exactly; 0: require KVTIER_MIN_MATCH, default
# 0.9, of the outputs to match), KVTIER_CONVERSATIONS (12), KVTIER_TURNS (4),
# KVTIER_GPU_BLOCKS (GPU KV blocks, 640), KVTIER_RUN_TIMEOUT (seconds per run, 240),
# KVTIER_EXTRA_CONFIG (the connector's kv_connector_extra_config as JSON, default
# {"cpu_bytes": 8589934592}; e.g. the CPU+disk cascade: {"cpu_bytes": 1073741824,
# "disk_bytes": 8589934592, "disk_path": "/tmp/kvtier-gpu-check-disk", "cascade":
# "write_back"}; a missing disk_path is created when its parent directory exists).
# One run takes a few minutes once the venv exists (the first pip install adds ~3-5).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVTIER_GPU_CHECK_VENV:-$ROOT/.venv-vllm-gpu}"
WORK="${KVTIER_GPU_CHECK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-check.XXXXXX")}"
PYTHON="${PYTHON:-python3}"
BATCH_INVARIANT="${KVTIER_BATCH_INVARIANT:-1}"
RUN_TIMEOUT="${KVTIER_RUN_TIMEOUT:-240}"
if [[ "$BATCH_INVARIANT" == "1" ]]; then MIN_MATCH="${KVTIER_MIN_MATCH:-1.0}"; else MIN_MATCH="${KVTIER_MIN_MATCH:-0.9}"; fi

log() { printf '[gpu_vllm_check] %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
trap 'log "FAILED at line $LINENO (exit $?); work dir: $WORK"' ERR

# ------------------------------------------------------------------ preflight
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this check needs a CUDA GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 \
  || die "nvidia-smi cannot see a GPU"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON)"
"$PYTHON" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 13) else 1)' \
  || die "$PYTHON is $("$PYTHON" -V 2>&1); vLLM 0.33 needs Python 3.10-3.13"
mkdir -p "$WORK"
log "work dir $WORK, venv $VENV"

# ------------------------------------------------------------------ environment
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c \
    'import importlib.metadata as m, sys; sys.exit(m.version("vllm") != "0.33.0")' 2>/dev/null; then
  log "reusing $VENV (vllm 0.33.0 present)"
else
  log "creating $VENV and installing vllm==0.33.0 (CUDA build; a few minutes)"
  "$PYTHON" -m venv "$VENV"
  timeout 900 "$VENV/bin/pip" install -q --upgrade pip || die "pip upgrade failed"
  timeout 900 "$VENV/bin/pip" install -q "vllm==0.33.0" || die "pip install vllm==0.33.0 failed"
fi
timeout 300 "$VENV/bin/pip" install -q -e "$ROOT" || die "pip install -e $ROOT failed"
"$VENV/bin/python" - <<'EOF' || die "vLLM's CUDA build or kvtier's connector does not import"
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
from kvtier.adapters.vllm import KVTierConnector  # noqa: F401  (imports vLLM too)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export VLLM_BATCH_INVARIANT="$BATCH_INVARIANT"

# ------------------------------------------------------------------ model
if [[ $# -ge 1 ]]; then
  MODEL="$(cd "$1" && pwd)" || die "model dir $1 does not exist"
  [[ -f "$MODEL/config.json" ]] || die "$MODEL has no config.json"
  log "model: $MODEL"
else
  MODEL="$WORK/tiny-llama"
  log "saving a random Llama (8 layers, hidden 1024) to $MODEL"
  timeout 300 "$VENV/bin/python" - "$MODEL" <<'EOF' || die "could not save the random model"
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
    tie_word_embeddings=False,
)
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(sys.argv[1], safe_serialization=True)
EOF
fi

# ------------------------------------------------------------------ workload
cat >"$WORK/run_chat.py" <<'EOF'
"""One multi-turn chat run through vLLM's offline API; writes outputs and TTFTs as JSON."""
import argparse, json, os, random, sys, time

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--mode", choices=("off", "kvtier"), required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--conversations", type=int, default=12)
parser.add_argument("--turns", type=int, default=4)
parser.add_argument("--gpu-blocks", type=int, default=640)
args = parser.parse_args()

from prometheus_client import REGISTRY
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

engine_args = dict(
    model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
    max_model_len=4096, block_size=16, enable_prefix_caching=True,
    num_gpu_blocks_override=args.gpu_blocks, gpu_memory_utilization=0.5,
    disable_log_stats=False, seed=0,
)
if args.mode == "kvtier":
    engine_args["kv_transfer_config"] = KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.adapters.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config=json.loads(
            os.environ.get("KVTIER_EXTRA_CONFIG") or '{"cpu_bytes": 8589934592}'
        ),
    )
llm = LLM(**engine_args)
vocab = min(llm.llm_engine.model_config.get_vocab_size(), 32000)
rng = random.Random(0)
tokens = lambda n: [rng.randrange(100, vocab) for _ in range(n)]
params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False)

def generate(prompt):
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = out.metrics.first_token_latency if out.metrics is not None else wall
    return list(out.outputs[0].token_ids), ttft, out.num_cached_tokens or 0

generate(tokens(512))  # warm-up: kernels, allocator
system = tokens(1024)  # shared by every conversation
histories = [system + tokens(1024) for _ in range(args.conversations)]
records = []
for turn in range(args.turns):
    for conv in range(args.conversations):
        prompt = histories[conv] + tokens(128)
        output, ttft, cached = generate(prompt)
        histories[conv] = prompt + output
        records.append(dict(conv=conv, turn=turn, prompt_len=len(prompt), output=output,
                            ttft_s=ttft, cached_tokens=cached))

def samples(prefix):
    found = {}
    for metric in REGISTRY.collect():
        if metric.name.startswith(prefix):
            for s in metric.samples:
                if s.name.endswith("_total") or metric.type == "gauge":
                    key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())
                                           if k not in ("model_name", "engine"))
                    found[key] = found.get(key, 0) + s.value
    return found

json.dump(dict(mode=args.mode, records=records, kvtier=samples("kvtier:"),
               vllm_external=samples("vllm:external_prefix_cache")), open(args.out, "w"))
print(f"{args.mode}: {len(records)} requests done")
EOF

for mode in off kvtier; do
  log "running the chat workload, connector: $mode"
  timeout "$RUN_TIMEOUT" "$VENV/bin/python" "$WORK/run_chat.py" --model "$MODEL" --mode "$mode" \
    --out "$WORK/$mode.json" --conversations "${KVTIER_CONVERSATIONS:-12}" \
    --turns "${KVTIER_TURNS:-4}" --gpu-blocks "${KVTIER_GPU_BLOCKS:-640}" \
    >"$WORK/$mode.log" 2>&1 \
    || { tail -n 40 "$WORK/$mode.log" >&2; die "the $mode run failed (log: $WORK/$mode.log)"; }
  grep -i "kvtier" "$WORK/$mode.log" | tail -n 5 >&2 || true
done

# ------------------------------------------------------------------ report
"$VENV/bin/python" - "$WORK/off.json" "$WORK/kvtier.json" "$MIN_MATCH" <<'EOF'
import json, statistics, sys
off, kv = (json.load(open(p)) for p in sys.argv[1:3])
min_match = float(sys.argv[3])
pairs = list(zip(off["records"], kv["records"], strict=True))
matches = sum(a["output"] == b["output"] for a, b in pairs)
print(f"\n{'turn':>4} {'TTFT off ms':>12} {'TTFT kvtier ms':>15} {'ratio':>6}"
      f" {'cached off':>11} {'cached kvtier':>14} {'exact':>6}")
ratios = []
for turn in sorted({a["turn"] for a, _ in pairs}):
    rows = [(a, b) for a, b in pairs if a["turn"] == turn]
    t_off = statistics.median(a["ttft_s"] for a, _ in rows) * 1e3
    t_kv = statistics.median(b["ttft_s"] for _, b in rows) * 1e3
    if turn > 0:
        ratios.append(t_kv / t_off)
    print(f"{turn:4d} {t_off:12.1f} {t_kv:15.1f} {t_kv / t_off:6.2f}"
          f" {sum(a['cached_tokens'] for a, _ in rows):11d}"
          f" {sum(b['cached_tokens'] for _, b in rows):14d}"
          f" {sum(a['output'] == b['output'] for a, b in rows):3d}/{len(rows)}")
hits = sum(v for k, v in kv["kvtier"].items() if k.startswith("kvtier:hit_tokens_total"))
failed = sum(v for k, v in kv["kvtier"].items() if k.startswith("kvtier:failed_loads_total"))
print(f"\nkvtier metrics: {json.dumps(kv['kvtier'], sort_keys=True)}")
print(f"vLLM external prefix cache (kvtier run): {json.dumps(kv['vllm_external'])}")
ratio = statistics.median(ratios) if ratios else float("nan")
print(f"\ngpu_vllm_check: exact match {matches}/{len(pairs)}, kvtier hit tokens {hits:.0f},"
      f" failed loads {failed:.0f}, TTFT of later turns kvtier/off {ratio:.2f}x")
problems = []
if matches < min_match * len(pairs):
    problems.append(f"outputs match {matches}/{len(pairs)} < {min_match:.0%} required")
if hits <= 0:
    problems.append("kvtier served no hit (GPU pool too large, or connector not active)")
if failed:
    problems.append(f"{failed:.0f} tier loads failed")
for problem in problems:
    print(f"[gpu_vllm_check] FAILED: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
log "passed; results in $WORK (off.json, kvtier.json, logs)"
