# Shared by scripts/slurm/*.sbatch (sourced, not run). Sets up the job's output directory
# and the rendezvous, starts the training ranks, and requeues a job that stopped early.
#
# Knobs (environment; pass them with `sbatch --export=ALL,NAME=value` or export before):
#   RRFP_REPO    repository checkout (default: $SLURM_SUBMIT_DIR, i.e. submit from the repo
#                root; SLURM runs a *copy* of the batch script, so it cannot find it itself)
#   RRFP_OUT     parent of every job's directory, outside the checkout (default $HOME/rrfp-out).
#                A job writes to $RRFP_OUT/<job name>/ -- the same directory when the job is
#                requeued or resubmitted under the same name, so it resumes there:
#                  checkpoints/   --save/--load: the latest checkpoint is loaded at start
#                  goodput.db     the goodput ledger, continued by every run of the job
#                  traces/        Chrome/Perfetto traces (one merged file per traced iteration)
#                  tensorboard/   TensorBoard scalars (Megatron-LM's tag names)
#                  job.env        one line per run: job id, restart count, nodes, settings
#                the training log itself is the job's --output file (default %x-%j.out)
#   RRFP_CPU=1   CPU mode: gloo, --cpu, tiny model, one rank per task (e.g. 2 tasks, 1 node)
#   MEGATRON_LM  a Megatron-LM checkout: run its entry script through
#                `python -m megatron_rrfp.launch` instead of `python -m megatron_rrfp.train`
#   DATA_PATH    a Megatron indexed dataset prefix (PREFIX.bin + PREFIX.idx) in both modes;
#                unset: synthetic data (own driver) / --mock-data (Megatron-LM)
#   PYTHON       interpreter (default python3); GPUS_PER_NODE (default: from SLURM / nvidia-smi)
#   RRFP_INPROCESS_RESTART=1  Megatron-LM only (MEGATRON_LM): --inprocess-restart (NVRx; the
#                'resilience' extra), --inprocess-granularity rank in CPU mode, and srun with
#                --kill-on-bad-exit=0: a rank NVRx terminates must not take the step down, or no
#                rank is left to restart in-process (docs/resilience.md, "the resilient recipe")
#   RRFP_MAX_RESTARTS  GPU mode: torchrun restarts every rank this often after a rank fails
#                (default 3); the restarted ranks resume from the latest checkpoint. On GPUs a
#                failed iteration (a dead peer, an RRFP stall) is not recovered in-process:
#                NCCL communicators with a dead peer are unusable, so the job restarts.
#
# Preemption and time limits: the batch scripts ask for `--requeue` and `--signal=USR1@120`;
# on SIGUSR1 every rank saves a checkpoint after its current iteration and exits 0
# (--exit-signal-handler --exit-signal SIGUSR1, in both modes), and rrfp_requeue_unless_done
# puts the job back in the queue when its last checkpoint is short of the last iteration.
# A job SLURM requeues itself (node failure, `scontrol requeue`) resumes the same way; the
# goodput ledger records the disruption and the restart.

set -euo pipefail

rrfp_die() { echo "rrfp: $*" >&2; exit 2; }

# rrfp_number NAME VALUE: VALUE must be a plain number (it ends up in command lines).
rrfp_number() {
    [[ "$2" =~ ^[0-9]+([.][0-9]*)?([eE][-+]?[0-9]+)?$ ]] || rrfp_die "$1='$2' is not a number"
}

rrfp_setup() {
    RRFP_REPO=${RRFP_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
    RRFP_REPO=$(cd "$RRFP_REPO" && pwd -P)
    if [[ ! -f "$RRFP_REPO/megatron_rrfp/train/driver.py" ]]; then
        rrfp_die "RRFP_REPO=$RRFP_REPO is not a megatron-rrfp checkout (submit from the repo root or set RRFP_REPO)"
    fi
    RRFP_OUT=${RRFP_OUT:-$HOME/rrfp-out}
    local name=${SLURM_JOB_NAME:-job}
    name=${name//\//_}
    JOB_DIR="$RRFP_OUT/$name"
    mkdir -p "$JOB_DIR"
    JOB_DIR=$(cd "$JOB_DIR" && pwd -P)
    case "$JOB_DIR/" in
        "$RRFP_REPO"/*) rrfp_die "RRFP_OUT=$RRFP_OUT is inside the checkout $RRFP_REPO; point it elsewhere" ;;
    esac
    CKPT_DIR="$JOB_DIR/checkpoints" TRACE_DIR="$JOB_DIR/traces" TB_DIR="$JOB_DIR/tensorboard"
    LEDGER="$JOB_DIR/goodput.db"
    mkdir -p "$CKPT_DIR" "$TRACE_DIR" "$TB_DIR"
    RRFP_CPU=${RRFP_CPU:-0}
    PYTHON=${PYTHON:-python3}
    export PYTHONPATH="$RRFP_REPO${PYTHONPATH:+:$PYTHONPATH}"

    # Rendezvous: the first node of the allocation hosts the c10d store.
    MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
    MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    export MASTER_ADDR MASTER_PORT

    if [[ "$RRFP_CPU" == 1 ]]; then
        export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
        export CUDA_VISIBLE_DEVICES=   # CPU mode on a GPU node: gloo ranks that see no GPU (megatron-core would use it)
        if [[ "${SLURM_JOB_NUM_NODES:-1}" == 1 && -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
            export GLOO_SOCKET_IFNAME=lo   # one node: loopback (containers often resolve the hostname oddly)
        fi
    else
        RRFP_MAX_RESTARTS=${RRFP_MAX_RESTARTS:-3}
        rrfp_number RRFP_MAX_RESTARTS "$RRFP_MAX_RESTARTS"
        GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}}}
        GPUS_PER_NODE=${GPUS_PER_NODE##*:}   # "h100:8" -> 8
        # NCCL / InfiniBand: sane defaults; uncomment what your fabric needs.
        export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
        # 2 = CleanUpOnly (torch's ProcessGroupNCCL.hpp): on a NCCL error or a timed-out collective the
        # watchdog aborts the communicators *without* tearing the process down, so a blocked rank gets an
        # exception and fails through RRFP's own path (state dump, its pair communicators aborted, the
        # ledger's disruption), then torchrun restarts it. 1 (TearDown, torchrun's default) would SIGABRT
        # the rank as soon as RRFP aborts its own communicators, before the diagnosis; 0 would leave a
        # hung Megatron collective hanging. docs/transport-and-agreement.md#timeout-order.
        export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-2}
        export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}          # Megatron's kernel ordering
        # export NCCL_SOCKET_IFNAME=ib0          # bootstrap interface (default: NCCL picks)
        # export NCCL_IB_HCA=mlx5_0,mlx5_1       # InfiniBand HCAs to use (default: all)
        # export NCCL_IB_GID_INDEX=3             # RoCE v2
        # export NCCL_IB_TIMEOUT=22              # long-haul fabrics: larger IB timeout
        # export NCCL_P2P_DISABLE=1              # consumer GPUs without PCIe P2P (e.g. RTX 4090)
        # export NCCL_NVLS_ENABLE=0              # if NVLink SHARP misbehaves
    fi
    WORLD_SIZE=$([[ "$RRFP_CPU" == 1 ]] && echo "$SLURM_NTASKS" || echo $((SLURM_JOB_NUM_NODES * GPUS_PER_NODE)))
    {
        echo "job=${SLURM_JOB_ID:-} restart=${SLURM_RESTART_COUNT:-0} name=${SLURM_JOB_NAME:-}" \
             "nodes=${SLURM_JOB_NODELIST:-} world=$WORLD_SIZE" \
             "mode=$([[ "$RRFP_CPU" == 1 ]] && echo cpu/gloo || echo cuda/nccl)${MEGATRON_LM:+ megatron_lm=$MEGATRON_LM}" \
             "repo=$RRFP_REPO out=$JOB_DIR master=$MASTER_ADDR:$MASTER_PORT python=$(command -v "$PYTHON")"
    } | tee -a "$JOB_DIR/job.env"
}

# rrfp_run MODULE ARGS...: `python -m MODULE ARGS...` as every rank of the job.
rrfp_run() {
    local module=$1 kill_on_bad_exit=1
    if [[ "${RRFP_INPROCESS_RESTART:-0}" == 1 ]]; then kill_on_bad_exit=0; fi  # NVRx restarts in-process (the knob)
    shift
    echo "rrfp: python -m $module on $WORLD_SIZE ranks: $*"
    if [[ "$RRFP_CPU" == 1 ]]; then
        # One rank per task. megatron_rrfp.train reads SLURM_PROCID/SLURM_NTASKS itself;
        # Megatron-LM reads only RANK/WORLD_SIZE/LOCAL_RANK, so those are set per task.
        if [[ "$module" == megatron_rrfp.train ]]; then
            srun --kill-on-bad-exit="$kill_on_bad_exit" "$PYTHON" -m "$module" "$@"
        else
            srun --kill-on-bad-exit="$kill_on_bad_exit" bash -c \
                'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec "$0" "$@"' \
                "$PYTHON" -m "$module" "$@"
        fi
    else
        # One torchrun per node; c10d rendezvous on the first node; one rank per GPU. SLURM's
        # --signal=USR1 reaches every process of the step: torchrun itself ignores it (its
        # default action would kill it), its ranks inherit that and install their own handler.
        # A new rendezvous store every round: torch >= 2.5 otherwise keeps one across restarts and
        # the restarted ranks meet the failed attempt's keys (docs/resilience.md).
        export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
        srun --ntasks-per-node=1 --kill-on-bad-exit="$kill_on_bad_exit" bash -c 'trap "" USR1; exec "$@"' rrfp-torchrun \
            "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$GPUS_PER_NODE" \
            --max-restarts "$RRFP_MAX_RESTARTS" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
            --module "$module" "$@"
    fi
}

# rrfp_requeue_unless_done TRAIN_ITERS: after a clean exit short of the last iteration (the
# ranks saved and stopped on SIGUSR1), put this job back in the queue: it resumes from there.
rrfp_requeue_unless_done() {
    local latest
    latest=$(tr -dc '0-9' < "$CKPT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null || true)
    if [[ -n "${SLURM_JOB_ID:-}" && "${latest:-0}" -lt "$1" ]]; then
        echo "rrfp: stopped after iteration ${latest:-0} of $1 (checkpoint saved); requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "rrfp: done; checkpoints, ledger, traces and TensorBoard under $JOB_DIR"
    fi
}
