#!/usr/bin/env bash
# NVIDIA's kvpress side by side with kvcompile, on the same model and the same prompts.
#   bash scripts/kvpress_env.sh setup            # only make the environment (.venv-kvpress)
#   bash scripts/kvpress_env.sh [needle] [--lengths 1000,2000] [--depths ...] [--budgets 64,128] ...
#        needle prompts, kvpress's SnapKV/PyramidKV/AdaKV against our same-named specs, kept tokens
#   bash scripts/kvpress_env.sh kept [kept-kvpress options, e.g. --presses snapkv,kvzip --limit 2]
#        kvpress's presses reproduced entry for entry (issue 35; scripts/kvpress_kept.py): RULER samples
#        (RULER_SAMPLES per task, default 2), each press's kept positions per layer, KV head and fraction
#        in kvpress's venv, then kvcompile's specs on the same ids and the agreement table
#        ($out/kept_summary.json; the per-head rows in $out/kept_rows.jsonl, resumed when run again; or
#        KEPT_SUMMARY, KEPT_ROWS), KEPT_BATCH prompts at a time (default 1) on each side in turn; KEPT_BASE:
#        an earlier run's summary, whose prompts are skipped and whose lines are pooled into the table
#   bash scripts/kvpress_env.sh ruler [kvcompile eval options, e.g. --specs snapkv,lava]
#        RULER: kvcompile generates the samples, kvpress's presses answer them through its own
#        pipeline in both query modes, kvcompile checks the token ids kvpress fed and scores
#        everything into one table (its specs at the same KV fractions beside kvpress's presses).
#        Settings (environment): RULER_SAMPLES (per task, default 10), RULER_LENGTHS (4096),
#        RULER_SEED (0), RULER_TASKS (all), KVPRESS_PRESSES (all nine), KVPRESS_FRACTIONS
#        (0.1,0.25,0.5), KVPRESS_MODES (aware,agnostic), KVPRESS_THREADS (2); KVPRESS_RESUME=1
#        keeps the predictions already written.  Long: see scripts/kvpress_compare.py's docstring.
#        Equal bytes (issue 24): KVPRESS_KV_BYTES=1/16,1/32 runs the presses over transformers'
#        QuantizedCache (KVPRESS_CACHES, default quanto4) at those shares of the full cache's bytes
#        instead of KVPRESS_FRACTIONS, and kvcompile's specs at the same bytes (--specs may name
#        NAME@int4, NAME@int8); docs/EVAL.md, "Equal bytes".
# kvpress pins transformers < 5.3, so it gets its own virtual environment (.venv-kvpress);
# kvcompile's environment (python3) makes the prompts and runs our specs.  Needs
# `bash scripts/setup.sh demo` first (the converted SmolLM2 and the haystack text).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
venv="${KVPRESS_VENV:-.venv-kvpress}"
out="${KVPRESS_OUT:-benchmarks/out}"
setup_venv() {
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import kvpress" 2>/dev/null; then
    "$py" -m venv "$venv"
    # The same CPU build of torch as kvcompile's, then kvpress with the transformers it pins
    # (kvpress 0.5.5: transformers >=4.56,<5.3).
    "$venv/bin/python" -m pip install -q "torch==2.13.0"
    "$venv/bin/python" -m pip install -q "kvpress==0.5.5"
  fi
  # transformers' QuantizedCache (the equal-bytes comparison, `ruler --kv-bytes`) needs a backend:
  # optimum-quanto (>= 0.2.5 for transformers' QuantoQuantizedLayer)
  if ! "$venv/bin/python" -c "import optimum.quanto" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q "optimum-quanto==0.2.7"
  fi
}
what=needle
case "${1:-}" in
  setup|needle|ruler|kept) what="$1"; shift ;;
esac
setup_venv
[ "$what" = setup ] && exit 0
mkdir -p "$out"
if [ "$what" = kept ]; then
  samples="$out/ruler_kept_samples.jsonl"
  [ -f "$samples" ] || "$py" -m kvcompile eval --suite ruler --samples "${RULER_SAMPLES:-2}" \
    --lengths "${RULER_LENGTHS:-4096}" --seed "${RULER_SEED:-0}" --dump-dataset "$samples"
  # KEPT_BATCH prompts of kvpress's side, then kvcompile's side on them, until kvpress's side has none left:
  # the table grows as the run goes, and a run killed loses at most the prompt in flight (both sides resume)
  kvp="$out/kept_kvpress.jsonl"
  # KEPT_BASE: an earlier run's summary: its prompts are skipped here and its lines pooled into the table
  # (KEPT_BASE_SKIP: the presses whose lines are left out of it, their specs having changed since)
  skip=(); base=()
  if [ -n "${KEPT_BASE:-}" ]; then
    skip=(--skip-prompts-of "$KEPT_BASE"); base=(--base "$KEPT_BASE")
    [ -n "${KEPT_BASE_SKIP:-}" ] && base+=(--base-skip "$KEPT_BASE_SKIP")
  fi
  while :; do
    before=$(grep -c '"kind": "prompt"' "$kvp" 2>/dev/null || true)
    "$venv/bin/python" scripts/kvpress_compare.py kept-kvpress --samples "$samples" --out "$kvp" \
      --threads "${KVPRESS_THREADS:-2}" --resume --max-prompts "${KEPT_BATCH:-1}" "${skip[@]}" "$@"
    after=$(grep -c '"kind": "prompt"' "$kvp" 2>/dev/null || true)
    "$py" scripts/kvpress_compare.py kept --samples "$samples" --kvpress "$kvp" \
      --rows "${KEPT_ROWS:-$out/kept_rows.jsonl}" --out "${KEPT_SUMMARY:-$out/kept_summary.json}" \
      --threads "${KVPRESS_THREADS:-2}" "${base[@]}"
    [ "$after" = "$before" ] && break
  done
  exit 0
fi
if [ "$what" = ruler ]; then
  samples="$out/ruler_samples.jsonl"
  preds="$out/kvpress_ruler.jsonl"
  tasks=()
  [ -n "${RULER_TASKS:-}" ] && tasks=(--tasks "$RULER_TASKS")
  "$py" -m kvcompile eval --suite ruler --samples "${RULER_SAMPLES:-10}" --lengths "${RULER_LENGTHS:-4096}" \
    --seed "${RULER_SEED:-0}" "${tasks[@]}" --dump-dataset "$samples"
  resume=()
  [ "${KVPRESS_RESUME:-0}" = 1 ] && resume=(--resume)
  budget=(--fractions "${KVPRESS_FRACTIONS:-0.1,0.25,0.5}")
  [ -n "${KVPRESS_KV_BYTES:-}" ] && budget=(--kv-bytes "$KVPRESS_KV_BYTES" --caches "${KVPRESS_CACHES:-quanto4}")
  "$venv/bin/python" scripts/kvpress_compare.py ruler --samples "$samples" --out "$preds" \
    --presses "${KVPRESS_PRESSES:-snapkv,pyramidkv,adakv_snapkv,streaming_llm,tova,observed_attention,knorm,expected_attention,kvzip}" \
    "${budget[@]}" --modes "${KVPRESS_MODES:-aware,agnostic}" \
    --threads "${KVPRESS_THREADS:-2}" "${resume[@]}"
  "$py" scripts/kvpress_compare.py tokens --samples "$samples" --tokens "$out/kvpress_ruler.tokens.json"
  "$py" scripts/kvpress_compare.py ruler-table --samples "$samples" --predictions "$preds" \
    --out "$out/ruler_compare.json" --plot-dir "$out/ruler_plots" "$@"
  exit 0
fi
"$py" scripts/kvpress_compare.py prompts --out "$out/kvpress_prompts.json" "$@"
"$venv/bin/python" scripts/kvpress_compare.py kvpress --prompts "$out/kvpress_prompts.json" \
  --out "$out/kvpress_results.json"
"$py" scripts/kvpress_compare.py kvcompile --prompts "$out/kvpress_prompts.json" \
  --kvpress "$out/kvpress_results.json" --out "$out/kvpress_compare.json"
