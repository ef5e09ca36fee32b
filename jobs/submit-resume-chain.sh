#!/bin/bash
# jobs/submit-resume-chain.sh: submit a chain of jobs/train-resume.sbatch segments, each
# starting when the previous one has ended, whatever its end (--dependency=afterany), and
# resuming from the latest checkpoint in the shared output directory.
#
# Usage (from the repository root):
#     jobs/submit-resume-chain.sh [SBATCH OPTIONS...]
# Environment:
#     MPIDIST_CHAIN_JOBS   number of segments (default 2)
#     MPIDIST_CHAIN_STEPS  the step each segment trains to, one number per segment
#                          ("200 400"); unset: every segment uses the script's default and
#                          the walltime (-t) ends each segment
#     MPIDIST_OUT          the chain's output directory (default runs/resume-chain)
#     MPIDIST_TRAIN_ARGS   and the other variables of jobs/common.sh, passed to every segment
# Prints the job ids, one per line, first segment first.

set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
read -r -a steps <<<"${MPIDIST_CHAIN_STEPS:-}"
jobs=${MPIDIST_CHAIN_JOBS:-${#steps[@]}}
[ "$jobs" -gt 0 ] || jobs=2
if [ "${#steps[@]}" -gt 0 ] && [ "${#steps[@]}" != "$jobs" ]; then
    echo "submit-resume-chain: MPIDIST_CHAIN_STEPS has ${#steps[@]} values for $jobs jobs" >&2
    exit 2
fi
export MPIDIST_HOME=${MPIDIST_HOME:-$(dirname "$here")}
export MPIDIST_OUT=${MPIDIST_OUT:-runs/resume-chain}

prev=
for ((k = 0; k < jobs; k++)); do
    export_vars=ALL
    [ "${#steps[@]}" -gt 0 ] && export_vars="ALL,MPIDIST_STEPS=${steps[k]}"
    dep=()
    [ -n "$prev" ] && dep=(--dependency="afterany:$prev")
    prev=$(sbatch --parsable "${dep[@]}" --export="$export_vars" "$@" \
        "$here/train-resume.sbatch")
    prev=${prev%%;*}  # --parsable prints "id;cluster" on federated clusters
    echo "$prev"
done
