#!/usr/bin/env bash
# The settings of docs/results.md's signal-share table ("Signal per sample and per second"), measured by
# scripts/measure/gradient_agreement.py at one domain's committed base, one JSON record per setting under OUT.
# Resumable: a setting whose record exists is skipped. Prints the table at the end.
#
#   bash scripts/measure/signal_sweep.sh camera OUT [REPEATS [PRESET]]   # tiny_cpu: 128 samples per update, one thread
#   bash scripts/measure/signal_sweep.sh motion OUT [REPEATS [PRESET]]   # motion_tiny_cpu: 64 samples per update
#   bash scripts/measure/signal_sweep.sh camera OUT 4 tiny_gpu           # the same settings at 2,048 samples, on a GPU
set -euo pipefail
domain=${1:?camera or motion}
out=${2:?output folder}
repeats=${3:-4}
preset=${4:-}
cd "$(dirname "$0")/../.."
py=${PYTHON:-python}

# label|preset suffix|overrides; the methods and k (at the preset's samples per update) are common to both domains
common=(
  "flow_grpo_fast|+flow_grpo_fast"
  "mixgrpo|+mixgrpo"
  "nft|+nft"
  "awm|+awm"
  "k 8|||--config.sample.k=8"
)
case "$domain" in
  camera)
    p=${preset:-tiny_cpu}
    # k 16 needs sampling batches that hold whole groups: the CPU preset's 8 become 16 (at the same 128 samples)
    k16="--config.sample.k=16"
    [ "$p" = tiny_cpu ] && k16="$k16 --config.sample.batch_size=16 --config.sample.num_batches_per_epoch=8"
    # noise: sample.noise_level, the preset's is 0.7; subspace: cosine components along the 32-pixel width
    settings=("preset (k 4, a 0.7)|" "${common[@]}" "k 16|||$k16"
      "noise a 0.4|||--config.sample.noise_level=0.4" "noise a 1.0|||--config.sample.noise_level=1.0"
      "subspace m 4|||--config.sample.noise_frequencies=4" "subspace m 8|||--config.sample.noise_frequencies=8") ;;
  motion)
    p=${preset:-motion_tiny_cpu}
    k16="--config.sample.k=16"
    [ "$p" = motion_tiny_cpu ] && k16="$k16 --config.sample.batch_size=16 --config.sample.num_batches_per_epoch=4"
    # noise: the trained steps' DDIM eta (motion.eta, the preset's is 1.0); subspace: cosine components along the
    # 196 frames
    settings=("preset (k 4, eta 1.0)|" "${common[@]}" "k 16|||$k16"
      "noise eta 0.3|||--config.motion.eta=0.3" "noise eta 0.6|||--config.motion.eta=0.6"
      "subspace m 8|||--config.sample.noise_frequencies=8" "subspace m 32|||--config.sample.noise_frequencies=32") ;;
  *) echo "[recam] domain must be camera or motion, got $domain" >&2; exit 2 ;;
esac
# one torch thread on the CPU presets (their own num_threads elsewhere)
threads=""
case "$p" in *_cpu) threads="--config.num_threads=1" ;; esac

mkdir -p "$out"
records=()
for s in "${settings[@]}"; do
  IFS='|' read -r label suffix _ extra <<< "$s"
  file="$out/$(echo "$label" | tr -c 'a-zA-Z0-9\n' '_' | sed 's/_*$//').json"
  [ -f "$file" ] && { records+=("$file"); continue; }
  echo "[sweep] $domain ($p): $label" >&2
  # shellcheck disable=SC2086
  if $py scripts/measure/gradient_agreement.py --config "config/grpo.py:$p$suffix" $threads \
      --repeats "$repeats" --label "$label" --out "$file" $extra > "$file.log" 2>&1; then
    records+=("$file")
  else
    echo "[sweep] $label failed: $file.log" >&2
  fi
done
if [ ${#records[@]} -eq 0 ]; then echo "[sweep] no setting finished" >&2; exit 1; fi
$py scripts/measure/gradient_agreement.py --table "$(IFS=,; echo "${records[*]}")"
