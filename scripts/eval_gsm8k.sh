#!/usr/bin/env bash
# GSM8K accuracy through the P/D proxy: lm-eval `local-completions` against the proxy's
# /v1/completions, then a results JSON plus a run manifest (versions, topology read from the
# servers, env, score, verdict). Exit 0 = score within the expected band, 1 = outside it,
# 2 = any error (proxy unreachable, lm-eval failed, no expected score for the model, ...).
#
# Usage: scripts/eval_gsm8k.sh [--base-url URL] [--model NAME] [--limit N] [--num-concurrent N]
#          [--num-fewshot N] [--output-dir DIR] [--data-dir DIR] [--prefill-url URL]
#          [--decode-url URL] [--max-gen-toks N]
# Env (flags win): EVAL_BASE_URL, EVAL_MODEL (default: the model the proxy serves), LIMIT, NUM_CONCURRENT, EVAL_OUTPUT_DIR,
#   GSM8K_DATA_DIR (offline: local train.jsonl/test.jsonl), EXPECTED_SCORE, SCORE_TOLERANCE,
#   PREFILL_URL, DECODE_URL, PYTHON.
# Expected strict-match: DeepSeek-V2-Lite-Chat 0.65 +- 0.05; any other model needs EXPECTED_SCORE.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXIT_ERROR=2

die() { printf 'eval_gsm8k: error: %s\n' "$*" >&2; exit "$EXIT_ERROR"; }
log() { printf '[eval_gsm8k] %s\n' "$*" >&2; }
usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

base_url="${EVAL_BASE_URL:-http://127.0.0.1:${PROXY_PORT:-8000}}"
model="${EVAL_MODEL:-}"
limit="${LIMIT:-}"
num_concurrent="${NUM_CONCURRENT:-100}"
num_fewshot="${NUM_FEWSHOT:-5}"
max_gen_toks="${MAX_GEN_TOKS:-256}"
output_dir="${EVAL_OUTPUT_DIR:-}"
data_dir="${GSM8K_DATA_DIR:-}"
prefill_url="${PREFILL_URL:-http://127.0.0.1:${PREFILL_PORT:-8100}}"
decode_url="${DECODE_URL:-http://127.0.0.1:${DECODE_PORT:-8200}}"

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --base-url) need_value "$@"; base_url="$2"; shift 2 ;;
    --model) need_value "$@"; model="$2"; shift 2 ;;
    --limit) need_value "$@"; limit="$2"; shift 2 ;;
    --num-concurrent) need_value "$@"; num_concurrent="$2"; shift 2 ;;
    --num-fewshot) need_value "$@"; num_fewshot="$2"; shift 2 ;;
    --max-gen-toks) need_value "$@"; max_gen_toks="$2"; shift 2 ;;
    --output-dir) need_value "$@"; output_dir="$2"; shift 2 ;;
    --data-dir) need_value "$@"; data_dir="$2"; shift 2 ;;
    --prefill-url) need_value "$@"; prefill_url="$2"; shift 2 ;;
    --decode-url) need_value "$@"; decode_url="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
[[ -z "$limit" ]] || { is_uint "$limit" && (( limit > 0 )); } || die "--limit must be a positive integer, got '$limit'"
{ is_uint "$num_concurrent" && (( num_concurrent > 0 )); } || die "--num-concurrent must be a positive integer, got '$num_concurrent'"
is_uint "$num_fewshot" || die "--num-fewshot must be a non-negative integer, got '$num_fewshot'"
{ is_uint "$max_gen_toks" && (( max_gen_toks > 0 )); } || die "--max-gen-toks must be a positive integer, got '$max_gen_toks'"
base_url="${base_url%/}"

# The kit's venv when present (bootstrap.sh makes it), else whatever python3 has lm-eval.
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "python not found ('$PYTHON'); run scripts/bootstrap.sh or set PYTHON"
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c 'import lm_eval' 2>/dev/null \
  || die "lm-eval is not installed for $PYTHON; install it with: $PYTHON -m pip install 'lm-eval[api]==0.4.13'"
helper() { "$PYTHON" -m gsm8k_eval "$@"; }

log "proxy: $base_url"
served_model="$(helper probe --url "$base_url")" || exit "$EXIT_ERROR"
# The expected score follows the model the server really serves, unless --model/EVAL_MODEL says.
model="${model:-$served_model}"
expectation="$(helper expected --model "$model")" || exit "$EXIT_ERROR"
read -r expected_score tolerance expected_source <<<"$expectation"
log "model: $model (served as $served_model); expected strict-match $expected_score +- $tolerance ($expected_source)"

if [[ -z "$output_dir" ]]; then
  output_dir="$ROOT/results/gsm8k-$(date -u +%Y%m%dT%H%M%SZ)"
fi
mkdir -p "$output_dir" || die "cannot create output dir $output_dir"
output_dir="$(cd "$output_dir" && pwd)"

task=gsm8k
task_args=()
if [[ -n "$data_dir" ]]; then
  [[ -d "$data_dir" ]] || die "GSM8K_DATA_DIR=$data_dir is not a directory"
  helper task --data-dir "$data_dir" --out-dir "$output_dir/tasks" >/dev/null || exit "$EXIT_ERROR"
  task=gsm8k_offline
  task_args=(--include_path "$output_dir/tasks")
  # Everything is local: keep datasets/hub from trying the network.
  export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
  log "offline GSM8K from $data_dir"
else
  log "GSM8K from the Hugging Face hub (set GSM8K_DATA_DIR for a local copy)"
fi
limit_args=()
[[ -z "$limit" ]] || limit_args=(--limit "$limit")

model_args="model=$served_model,base_url=$base_url/v1/completions,num_concurrent=$num_concurrent"
model_args+=",max_retries=3,tokenized_requests=False,tokenizer_backend=none,max_gen_toks=$max_gen_toks"
started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
log "running lm-eval ($task, ${limit:-all} questions, $num_fewshot-shot, $num_concurrent concurrent)"
# lm-eval draws its own progress bar for the requests on stderr.
if ! "$PYTHON" -m lm_eval run \
    --model local-completions \
    --model_args "$model_args" \
    --tasks "$task" \
    --num_fewshot "$num_fewshot" \
    --batch_size 1 \
    --output_path "$output_dir/lm_eval" \
    --log_samples \
    "${task_args[@]}" "${limit_args[@]}" \
    2> >(tee "$output_dir/lm_eval.log" >&2); then
  die "lm-eval failed (log: $output_dir/lm_eval.log)"
fi

run_json="$("$PYTHON" -c 'import json,sys; print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' \
  started "$started" base_url "$base_url" model "$model" served_model "$served_model" task "$task" \
  limit "${limit:-all}" num_concurrent "$num_concurrent" num_fewshot "$num_fewshot" \
  max_gen_toks "$max_gen_toks" data_dir "${data_dir:-hub}")"
set +e
helper finish --output-dir "$output_dir" --task "$task" --model "$model" --base-url "$base_url" \
  --server "prefill=$prefill_url" --server "decode=$decode_url" --run-json "$run_json"
status=$?
set -e
exit "$status"
