#!/usr/bin/env bash
# The settings of docs/results.md's signal-share table ("Signal per sample and per CPU second"), measured by
# scripts/gradient_agreement.py at one domain's committed base, one torch thread each, one JSON record per setting
# under OUT. Resumable: a setting whose record exists is skipped. Prints the table at the end.
#
#   bash scripts/signal_sweep.sh camera OUT [REPEATS]     # tiny_cpu's base, 128 samples per update
#   bash scripts/signal_sweep.sh motion OUT [REPEATS]     # motion_tiny_cpu's base, 64 samples per update
set -euo pipefail
domain=${1:?camera or motion}
out=${2:?output folder}
repeats=${3:-4}
cd "$(dirname "$0")/.."
py=${PYTHON:-python}

case "$domain" in
  camera)
    p=tiny_cpu
    # label|preset suffix|overrides (k at 128 samples per update, a sampling batch holding whole groups; noise: sample.noise_level, the preset's is 0.7;
    # subspace: cosine components along the 32-pixel width)
    settings=(
      "preset (k 4, a 0.7)|"
      "flow_grpo_fast|+flow_grpo_fast"
      "mixgrpo|+mixgrpo"
      "nft|+nft"
      "awm|+awm"
      "k 8|||--config.sample.k=8"
      "k 16|||--config.sample.k=16 --config.sample.batch_size=16 --config.sample.num_batches_per_epoch=8"
      "noise a 0.4|||--config.sample.noise_level=0.4"
      "noise a 1.0|||--config.sample.noise_level=1.0"
      "subspace m 4|||--config.sample.noise_frequencies=4"
      "subspace m 8|||--config.sample.noise_frequencies=8"
    ) ;;
  motion)
    p=motion_tiny_cpu
    # noise: the trained steps' DDIM eta (motion.eta, the preset's is 1.0); subspace: cosine components along the
    # 196 frames
    settings=(
      "preset (k 4, eta 1.0)|"
      "flow_grpo_fast|+flow_grpo_fast"
      "mixgrpo|+mixgrpo"
      "nft|+nft"
      "awm|+awm"
      "k 8|||--config.sample.k=8"
      "k 16|||--config.sample.k=16 --config.sample.batch_size=16 --config.sample.num_batches_per_epoch=4"
      "noise eta 0.3|||--config.motion.eta=0.3"
      "noise eta 0.6|||--config.motion.eta=0.6"
      "subspace m 8|||--config.sample.noise_frequencies=8"
      "subspace m 32|||--config.sample.noise_frequencies=32"
    ) ;;
  *) echo "[recam] domain must be camera or motion, got $domain" >&2; exit 2 ;;
esac

mkdir -p "$out"
records=()
for s in "${settings[@]}"; do
  IFS='|' read -r label suffix _ extra <<< "$s"
  file="$out/$(echo "$label" | tr -c 'a-zA-Z0-9\n' '_' | sed 's/_*$//').json"
  records+=("$file")
  [ -f "$file" ] && continue
  echo "[sweep] $domain: $label" >&2
  # shellcheck disable=SC2086
  $py scripts/gradient_agreement.py --config "config/grpo.py:$p$suffix" --config.num_threads=1 \
      --repeats "$repeats" --label "$label" --out "$file" $extra > "$file.log" 2>&1 \
    || { echo "[sweep] $label failed: $file.log" >&2; records=("${records[@]:0:${#records[@]}-1}"); }
done
$py scripts/gradient_agreement.py --table "$(IFS=,; echo "${records[*]}")"
