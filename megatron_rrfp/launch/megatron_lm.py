"""Run an unmodified Megatron-LM entry script with megatron-rrfp installed, in each rank that
torchrun or srun started (``python -m megatron_rrfp.launch``, ``__main__.py``).

    torchrun --nproc-per-node 8 -m megatron_rrfp.launch pretrain_gpt.py \\
        --pipeline-model-parallel-size 8 --pipeline-schedule rrfp ...   # + Megatron's flags

Everything after the script path goes to the script unchanged; the launcher's own
options come before it. The script runs as ``__main__`` with the same ``sys.argv`` and
``sys.path[0]`` that ``python SCRIPT ...`` would give it, so it imports its neighbours
(gpt_builders.py, model_provider.py) and its checkout's ``megatron`` package as usual.

``--cpu`` (or ``RRFP_CPU=1``) trains on CPU over gloo, on a GPU host too (the process then
sees no CUDA device, hidden before anything imports torch): CUDA device,
stream, event, RNG and synchronize calls are redirected to CPU equivalents,
``torch.cuda.device_count()`` reports 1, the device properties Megatron asks for at TP > 1
describe a "cpu" device, ``initialize_megatron`` gets ``allow_no_cuda=True`` and no fused
kernels are built (``megatron_rrfp/cpu/megatron_lm.py``). A tiny GPT at TP=2 x PP=2 (and DP=2 x PP=2),
checked with Megatron-LM core_v0.16.1 and the megatron-core 0.16.1 wheel; ``pip install
'megatron-rrfp[megatron-lm]'`` installs what megatron.training imports and pybind11, with
which Megatron builds its dataset helpers at start-up::

    torchrun --nproc-per-node 4 -m megatron_rrfp.launch --cpu $MEGATRON_LM/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule rrfp \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 \
        --lr 1e-3 --min-lr 1e-4 --lr-decay-style constant --clip-grad 0 \
        --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --split 98,2,0 \
        --log-interval 1 --eval-iters 0 --eval-interval 1000 \
        --transformer-impl local --use-cpu-initialization --distributed-backend gloo \
        --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion \
        --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion \
        --no-gradient-accumulation-fusion --attention-dropout 0 --hidden-dropout 0 --seed 1234

Under ``torchrun --max-restarts N`` a restarted worker's ``init_process_group`` keys are kept apart
from the failed attempt's in torchrun's store (``env.keep_restart_keys_apart``).

``--clip-grad`` > 0 works too (megatron-core's clipping asserts CUDA grads; ``--cpu`` calls
it through its dtype-checked ``decoupled_grad`` path).

LLaVA (``$MEGATRON_LM/pretrain_vlm.py``): the same flags with ``--num-layers 4 --img-h 28
--img-w 28 --patch-dim 14 --decoder-seq-length 128 --max-position-embeddings 128
--ckpt-format torch``; ``--cpu`` builds the ViT's ``ln_pre`` (a plain torch LayerNorm without
TE) as megatron-core's WrappedTorchNorm.

HybridModel (Megatron-LM 0.18+): ``$MEGATRON_LM/pretrain_hybrid.py`` with the same flags,
``--hybrid-layer-pattern '*-|*-'`` instead of ``--num-layers`` and ``--spec
megatron_rrfp.mcore.hybrid_spec hybrid_stack_spec`` (local attention / MLP layers; the
stock spec needs Transformer Engine).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_rrfp.launch",
        description="Run a Megatron-LM entry script (pretrain_gpt.py, pretrain_vlm.py, ...) unmodified, "
                    "with --pipeline-schedule {1f1b,rrfp} and the --rrfp-* flags added to its parser.")
    parser.add_argument("--cpu", action="store_true", default=os.environ.get("RRFP_CPU", "") == "1",
                        help="run on CPU over gloo (no CUDA needed); also RRFP_CPU=1")
    parser.add_argument("script", help="the entry script, e.g. <Megatron-LM>/pretrain_gpt.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    opts = parser.parse_args(argv)
    script = os.path.abspath(opts.script)
    if not os.path.isfile(script):
        parser.error(f"script {opts.script!r} not found (resolved to {script})")

    # What `python SCRIPT args` does, before anything imports megatron: the script's
    # directory decides which megatron package (checkout or installed) is found.
    sys.argv = [script, *opts.script_args]
    sys.path.insert(0, os.path.dirname(script))
    from ..megatron_lm.inprocess import nvrx_conflict

    conflict = nvrx_conflict()  # else `import megatron.core` fails on every rank with an AttributeError
    if conflict:
        parser.error(conflict)

    if opts.cpu:
        from .env import hide_cuda

        hide_cuda()  # before megatron (or anything) asks torch for the device count
        from ..cpu import enable_cpu_training

        enable_cpu_training()
    from .env import keep_restart_keys_apart

    restart = keep_restart_keys_apart()  # after hide_cuda: it may import torch
    if restart and os.environ.get("RANK") == "0":
        print(restart, file=sys.stderr, flush=True)
    from ..megatron_lm.install import install

    install()
    runpy.run_path(script, run_name="__main__")

