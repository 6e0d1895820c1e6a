# Shared by scripts/slurm/*.sbatch (sourced, not run). Sets up the output tree and the
# rendezvous, then starts one training rank per GPU (torchrun, one per node) or, in CPU
# mode, one rank per SLURM task.
#
# Knobs (environment; pass them with `sbatch --export=ALL,NAME=value` or export before):
#   RRFP_REPO    repository checkout (default: $SLURM_SUBMIT_DIR, i.e. submit from the repo
#                root; SLURM runs a *copy* of the batch script, so it cannot find it itself)
#   RRFP_OUT     where this job writes (default $RRFP_REPO/rrfp-out/<job name>-<job id>):
#                  $RRFP_OUT/checkpoints/        --save/--load (a requeued job resumes)
#                  $RRFP_OUT/traces/             Chrome/Perfetto traces of the last iteration
#                  $RRFP_OUT/goodput.sqlite      goodput ledger (Megatron-LM mode)
#                  $RRFP_OUT/job.env             the resolved settings of this job
#                the training log itself is the job's --output file (default %x-%j.out)
#   RRFP_CPU=1   CPU mode: gloo, --cpu, tiny model, one rank per task (e.g. 2 tasks, 1 node)
#   MEGATRON_LM  a Megatron-LM checkout: run its entry script through
#                `python -m megatron_rrfp.launch` instead of `python -m megatron_rrfp.train`
#   PYTHON       interpreter (default python3); GPUS_PER_NODE (default: from SLURM / nvidia-smi)

set -euo pipefail

rrfp_setup() {
    RRFP_REPO=${RRFP_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
    RRFP_REPO=$(cd "$RRFP_REPO" && pwd)
    if [[ ! -f "$RRFP_REPO/megatron_rrfp/train/driver.py" ]]; then
        echo "rrfp: RRFP_REPO=$RRFP_REPO is not a megatron-rrfp checkout (submit from the repo root or set RRFP_REPO)" >&2
        exit 2
    fi
    RRFP_OUT=${RRFP_OUT:-$RRFP_REPO/rrfp-out/${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID:-local}}
    RRFP_CPU=${RRFP_CPU:-0}
    PYTHON=${PYTHON:-python3}
    mkdir -p "$RRFP_OUT/checkpoints" "$RRFP_OUT/traces"
    export PYTHONPATH="$RRFP_REPO${PYTHONPATH:+:$PYTHONPATH}"

    # Rendezvous: the first node of the allocation hosts the c10d store.
    MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
    MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    export MASTER_ADDR MASTER_PORT

    if [[ "$RRFP_CPU" == 1 ]]; then
        export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
        if [[ "${SLURM_JOB_NUM_NODES:-1}" == 1 && -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
            export GLOO_SOCKET_IFNAME=lo   # one node: loopback (containers often resolve the hostname oddly)
        fi
    else
        GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}}}
        GPUS_PER_NODE=${GPUS_PER_NODE##*:}   # "h100:8" -> 8
        # NCCL / InfiniBand: sane defaults; uncomment what your fabric needs.
        export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
        export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # fail fast, not hang
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
        echo "job=${SLURM_JOB_ID:-} name=${SLURM_JOB_NAME:-} nodes=${SLURM_JOB_NODELIST:-} world=$WORLD_SIZE"
        echo "mode=$([[ "$RRFP_CPU" == 1 ]] && echo cpu/gloo || echo cuda/nccl)${MEGATRON_LM:+ megatron_lm=$MEGATRON_LM}"
        echo "repo=$RRFP_REPO out=$RRFP_OUT master=$MASTER_ADDR:$MASTER_PORT python=$(command -v "$PYTHON")"
    } | tee "$RRFP_OUT/job.env"
}

# rrfp_run MODULE ARGS...: `python -m MODULE ARGS...` as every rank of the job.
rrfp_run() {
    local module=$1
    shift
    echo "rrfp: python -m $module on $WORLD_SIZE ranks: $*"
    if [[ "$RRFP_CPU" == 1 ]]; then
        # One rank per task. megatron_rrfp.train reads SLURM_PROCID/SLURM_NTASKS itself;
        # Megatron-LM reads only RANK/WORLD_SIZE/LOCAL_RANK, so those are set per task.
        if [[ "$module" == megatron_rrfp.train ]]; then
            srun --kill-on-bad-exit=1 "$PYTHON" -m "$module" "$@"
        else
            srun --kill-on-bad-exit=1 bash -c \
                'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec "$0" "$@"' \
                "$PYTHON" -m "$module" "$@"
        fi
    else
        # One torchrun per node; c10d rendezvous on the first node; one rank per GPU.
        srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
            "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$GPUS_PER_NODE" \
            --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
            --module "$module" "$@"
    fi
}
