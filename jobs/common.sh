# jobs/common.sh: the environment every jobs/*.sbatch script sources. Not a job itself.
#
# A batch script runs from a copy in Slurm's spool directory, so the scripts find this file
# through MPIDIST_HOME (default: the directory sbatch was run from, SLURM_SUBMIT_DIR):
# submit from the repository root, or set MPIDIST_HOME=/path/to/mpidist.
#
# Variables (all optional; sbatch passes the submitting shell's environment to the job):
#   MPIDIST_HOME        the mpidist checkout (default: $SLURM_SUBMIT_DIR)
#   MPIDIST_VENV        the virtual environment with mpidist installed (default:
#                       $MPIDIST_HOME/.venv, made by `make setup`)
#   MPIDIST_SRUN_MPI    srun's --mpi plugin (default pmix; pmi2 or pmix_v4 on some sites)
#   MPIDIST_TRAIN_ARGS  extra `mpidist train` flags, appended last so they override the
#                       script's own (e.g. a tiny model for CI: "--steps 6 --n-layer 1 ...")
#   MPIDIST_OUT         the run's output directory (each script documents its default)

# Site modules: load the MPI and parallel HDF5 that the venv's mpi4py and h5py were built
# against (names vary by site; `module avail` lists them). Examples:
# module load openmpi/4.1 hdf5/1.12.2-openmpi python/3.11
# module load cray-mpich cray-hdf5-parallel cray-python

MPIDIST_HOME=${MPIDIST_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
MPIDIST_VENV=${MPIDIST_VENV:-$MPIDIST_HOME/.venv}
if [ ! -x "$MPIDIST_VENV/bin/mpidist" ]; then
    echo "mpidist job: no mpidist in MPIDIST_VENV=$MPIDIST_VENV (run \`make setup\` in" \
        "the checkout, or set MPIDIST_VENV)" >&2
    exit 2
fi
# PATH rather than `activate`: the same on every shell and with `set -u`.
export VIRTUAL_ENV=$MPIDIST_VENV
export PATH="$MPIDIST_VENV/bin:$PATH"

# Open MPI refuses to run as root without these (containers, CI); they change nothing for
# ordinary users, so only root gets them.
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# One BLAS and one Numba thread per CPU given to the task (ranks are the parallelism).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$OMP_NUM_THREADS}
export NUMBA_NUM_THREADS=${NUMBA_NUM_THREADS:-$OMP_NUM_THREADS}
export PYTHONUNBUFFERED=1

MPIDIST_SRUN_MPI=${MPIDIST_SRUN_MPI:-pmix}
# shellcheck disable=SC2206  # word splitting of the extra flags is intended
MPIDIST_EXTRA=(${MPIDIST_TRAIN_ARGS:-})

# One line that says where and how the job runs (in the job's output file).
echo "mpidist job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}): ${SLURM_NTASKS:-?} task(s) on" \
    "${SLURM_JOB_NUM_NODES:-?} node(s) [${SLURM_JOB_NODELIST:-?}], venv $MPIDIST_VENV," \
    "srun --mpi=$MPIDIST_SRUN_MPI"
