# Sourced by bench/families.sh and bench/llamacpp.sh: their entries, family:block_size
# (drafter.family, drafter.block_size), read from $FAMILIES into ENTRIES and checked before any
# work starts; `entry_args ENTRY` sets NAME (the run folder's name) and ARGS (its --set options:
# configs/demo.toml's family options back to their defaults for the other families, DFlash2's
# selector and DSpark's Markov head at rank 64).
read -ra ENTRIES <<< "${FAMILIES:-"dflash:4 dflash:5 dflash2:5 dspark:4"}"
for entry in "${ENTRIES[@]}"; do
  case $entry in
    dflash:* | dflash2:* | dspark:*) block=${entry#*:} ;;
    *) block=x ;;
  esac
  case $block in
    [2-9] | [1-9][0-9] | 1[0-9][0-9] | 2[0-4][0-9] | 25[0-6]) ;;
    *) echo "bench: '$entry' is not family:block_size (dflash, dflash2 or dspark; a block of 2 to 256; e.g. dflash2:5)" >&2
       exit 2 ;;
  esac
done

entry_args() {
  local family=${1%%:*} block=${1#*:}
  NAME="families_${family}_b$block"
  ARGS=(--set "run.name=\"$NAME\"" --set "drafter.family=\"$family\"" --set "drafter.block_size=$block")
  case $family in
    dflash) ARGS+=(--set drafter.dspark.markov_rank=256) ;;
    dflash2) ARGS+=(--set drafter.dspark.markov_rank=256 --set drafter.dflash2.selector_rank=64) ;;
    dspark) ARGS+=(--set drafter.dspark.markov_rank=64) ;;
  esac
}
