"""RRFP vs megatron-core's own schedule, same model, data and seeds, inside one launch: the cases.

``run_case(case)`` runs on every rank (via ``launch.function.launch``): it builds two identical
copies of a model stage (GPT, MLP, multimodal, MoE), and the package's
``selfcheck.equivalence.compare_with_megatron`` trains one with megatron-core's 1F1B schedule and
the other with ``forward_backward_rrfp`` under injected random delays; it returns the largest
relative differences of losses and gradients plus the orders RRFP executed. Data parallelism
uses megatron-core's DistributedDataParallel with its ``no_sync`` and ``finalize_model_grads``
hooks, as Megatron-LM's training loop does.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from . import mlp


@dataclass(kw_only=True, slots=True)
class Case:
    model: str = "gpt"
    """gpt (megatron-core GPTModel, local spec), mlp (column/row-parallel MLP stages),
    multimodal (recipes.multimodal: ViT + projector on stage 0, GPT decoder) or moe (GPTModel
    with 4 experts, top-2, alltoall dispatcher, SequentialMLP, aux loss; each data-parallel
    replica draws its own data, so the experts' loads and all-to-all splits differ) or moe_grouped
    (the same with megatron-core's TEGroupedMLP experts over helpers.te_package, which the
    rank must have installed: grouped_gemm_cases does)."""
    num_microbatches: int = 8
    iterations: int = 1
    forward_only: bool = False
    hint: object = "bf"
    """A hint name or a Hint (policy.hints)."""
    strict: bool = False
    buffer_limit: int | str = 32
    max_task_delay_s: float = 0.01
    """Each task sleeps U(0, max) first, drawn per rank: stages drift out of 1F1B's rhythm."""
    late_rank: Optional[int] = None
    """This global rank receives every message ``late_delay_s`` late (e.g. one TP rank)."""
    late_delay_s: float = 0.03
    delay_seed: int = 0
    learning_rate: float = 0.05
    seq_length: int = 16
    micro_batch_size: int = 2
    vocab_size: int = 64
    timeout_s: float = 60.0
    variable_seq_lengths: bool = False
    """mlp only: every microbatch has its own sequence length (config.variable_seq_lengths)."""
    per_token_loss: bool = False
    """config.calculate_per_token_loss: finalize_model_grads divides by the total token count."""
    transport: str = "auto"
    """RRFPConfig.transport: 'rounds' runs the device (NCCL) protocol over gloo."""
    sequence_parallel: bool = False
    """gpt only: megatron's sequence parallelism (TP > 1), torch norms marked sequence_parallel."""
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: Optional[int] = None
    """DDP's bucket size in elements (small: several buckets, to see them launch one by one)."""
    dp_overlap: str = "auto"
    """RRFPConfig.dp_overlap ('after-loop': every reduction after the task loop, on any device)."""
    microbatches_per_iteration: tuple[int, ...] = ()
    """The number of microbatches of each iteration, as Megatron's sequence-packing schedulers
    change it from one call to the next (default: ``num_microbatches`` every iteration)."""


def _build(case: Case, data_parallel: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_rrfp.train import models

    if case.model in ("moe", "moe_grouped"):
        grouped = case.model == "moe_grouped"
        config = models.tiny_gpt_config(num_layers=2 * models.parallel_sizes()[1], **moe_options(grouped=grouped))
    elif case.model == "gpt":
        config = models.tiny_gpt_config(num_layers=2 * models.parallel_sizes()[1],
                                        sequence_parallel=case.sequence_parallel)
    else:
        config = models.tiny_gpt_config()
    if case.model == "moe_grouped":
        from .te_package import build_grouped_moe_stage

        stage = build_grouped_moe_stage(config, vocab_size=case.vocab_size, seq_length=case.seq_length, seed=11)
    elif case.model in ("gpt", "moe"):
        stage = models.build_gpt_stage(config, vocab_size=case.vocab_size, seq_length=case.seq_length, seed=11)
    elif case.model == "multimodal":
        from megatron_rrfp.train.recipes import multimodal

        spec = multimodal.MultimodalSpec(seq_length=case.seq_length, vocab_size=case.vocab_size)
        stage = multimodal.build_multimodal_stage(multimodal.multimodal_config(), spec, seed=11)
    else:
        stage = mlp.build_mlp_stage(config, seed=11)
    config = getattr(stage, "config", config)
    config.variable_seq_lengths = case.variable_seq_lengths
    config.calculate_per_token_loss = case.per_token_loss
    if data_parallel > 1:
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=case.use_distributed_optimizer,
                                                   overlap_grad_reduce=case.overlap_grad_reduce,
                                                   bucket_size=case.bucket_size)
        stage = DistributedDataParallel(config, ddp_config, stage)
        config.no_sync_func = stage.no_sync
        config.finalize_model_grads_func = finalize_model_grads
    return stage


def moe_options(grouped: bool = False) -> dict:
    """``grouped``: grouped-GEMM experts; no linear biases (production MoE models have none, and
    the TE stand-in's grouped GEMM has none)."""
    from megatron.core import parallel_state

    extra = dict(add_bias_linear=False) if grouped else {}
    return dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped,
                **extra,
                expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss")


def _data(case: Case, iteration: int):
    from megatron_rrfp.train import models

    if case.model in ("gpt", "moe", "moe_grouped"):
        if case.model != "gpt":
            from megatron.core import parallel_state

            iteration += 1000 * parallel_state.get_data_parallel_rank()
        return models.synthetic_gpt_batches(seed=100 + iteration, micro_batch_size=case.micro_batch_size,
                                            seq_length=case.seq_length, vocab_size=case.vocab_size)
    if case.model == "multimodal":  # images per sample ~ Poisson(1): encoder work varies per micro-batch
        from megatron_rrfp.train.recipes import multimodal

        spec = multimodal.MultimodalSpec(seq_length=case.seq_length, vocab_size=case.vocab_size)
        return multimodal.synthetic_multimodal_batches(spec, seed=100 + iteration,
                                                       micro_batch_size=case.micro_batch_size,
                                                       images_per_sample_mean=1.0)
    if case.variable_seq_lengths:
        return _variable_length_mlp_batches(case, seed=100 + iteration)
    return mlp.synthetic_mlp_batches(seed=100 + iteration, micro_batch_size=case.micro_batch_size,
                                        seq_length=case.seq_length, hidden_size=32)


def _variable_length_mlp_batches(case: Case, seed: int):
    """Like mlp.synthetic_mlp_batches, but each microbatch draws its own sequence length."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        length = int(torch.randint(2, 2 * case.seq_length, (1,), generator=generator))
        shape = (length, case.micro_batch_size, 32)
        yield {"inputs": torch.randn(shape, generator=generator), "targets": torch.randn(shape, generator=generator)}


def run_case(case: Case) -> dict:
    """``compare_with_megatron`` on ``case``'s model; what the tests assert, as a dict."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rrfp.bench.around_schedules import HeldMessages, sleep_before_tasks
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.session import shutdown
    from megatron_rrfp.policy.hints import megatron_1f1b_order
    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.selfcheck.equivalence import compare_with_megatron
    from megatron_rrfp.train import models

    enable_cpu_reference_schedules()
    rank = dist.get_rank()
    data_parallel = parallel_state.get_data_parallel_world_size()
    reference, candidate = _build(case, data_parallel), _build(case, data_parallel)
    forward_step = models.gpt_forward_step if case.model in ("gpt", "moe", "moe_grouped") else mlp.mlp_forward_step
    if case.model == "multimodal":
        from megatron_rrfp.train.recipes.multimodal import multimodal_forward_step as forward_step
    rng = random.Random(case.delay_seed * 1000 + rank)
    tasks_started = [0]

    def task_delay(task):  # also counts RRFP's tasks, to place the bucket launches
        tasks_started[0] += 1
        return rng.uniform(0.0, case.max_task_delay_s) if case.max_task_delay_s else 0.0

    # the delays perturb RRFP's order only: they are its options (RRFPConfig.around_task, deliver_message)
    late = HeldMessages(lambda message: case.late_delay_s) if case.late_rank == rank else None
    options = RRFPConfig.of(hint=case.hint, strict=case.strict, buffer_limit=case.buffer_limit,
                            timeout_s=case.timeout_s, transport=case.transport, dp_overlap=case.dp_overlap,
                            around_task=sleep_before_tasks(task_delay), deliver_message=late)
    launches = _record_bucket_launches(candidate, tasks_started)
    launch_log: list = []

    def after_iteration(iteration: int) -> None:  # the bucket launches of this iteration's RRFP run
        launch_log.append({"launched_at_task": list(launches), "tasks": tasks_started[0]})
        tasks_started[0] = 0
        launches.clear()

    stage = parallel_state.get_pipeline_model_parallel_rank()
    topology = Topology(parallel_state.get_pipeline_model_parallel_world_size())
    megatron_order = ",".join(map(str, megatron_1f1b_order(stage, topology, case.num_microbatches)))
    found = compare_with_megatron(
        [reference], [candidate], forward_step=forward_step, data=lambda iteration: _data(case, iteration),
        microbatches=[case.microbatches_per_iteration[i] if case.microbatches_per_iteration else case.num_microbatches
                      for i in range(case.iterations)],
        seq_length=case.seq_length, micro_batch_size=case.micro_batch_size, rrfp_config=options,
        learning_rate=case.learning_rate, forward_only=case.forward_only, after_iteration=after_iteration)
    reports = found.reports
    calibrations = _calibrations()
    shutdown()
    grouped_te = None
    if case.model == "moe_grouped":
        from .te_package import grouped_experts_report

        grouped_te = grouped_experts_report(candidate)
    return {
        "rank": rank, "stage": stage, "loss_rel_err": found.loss_rel_err, "grad_rel_err": found.grad_rel_err,
        "losses_megatron": found.losses_megatron, "losses_rrfp": found.losses_rrfp,
        "orders": [r.order_string for r in reports], "megatron_order": megatron_order,
        "num_losses": len(found.losses_rrfp), "case": asdict(case),
        "peak_deferred_wgrad_bytes": max([0] + [r.peak_deferred_wgrad_bytes for r in reports]),
        "agree_rounds": sum(r.agree_rounds for r in reports), "bucket_launches": launch_log,
        "grouped_te": grouped_te, "unsplit_backwards": sum(r.unsplit_backwards for r in reports),
        "calibrations": calibrations,
    }


def _calibrations() -> dict:
    """This process's buffer-limit calibrations as (M, measured, agreed) per kind, read from
    its ScheduleState (each is keyed by what it depends on, M last)."""
    from megatron_rrfp.mcore.state import ScheduleState

    state = ScheduleState.get()
    return {"bytes": sorted((key[-1], c.measured is not None, c.budgets is not None)
                            for key, c in state.byte_budgets.items()),
            "auto": sorted((key[-1], c.bytes_per_forward is not None, c.limits is not None)
                           for key, c in state.auto_limits.items())}


def _record_bucket_launches(model, tasks_started: list) -> list:
    """Wrap (from outside) each DDP bucket group's start_grad_sync: (the RRFP task count at
    which it launched — tasks_started counts tasks as they start —, whether finish_grad_sync
    launched it, i.e. after the schedule)."""
    launches: list = []
    for group in getattr(model, "bucket_groups", ()):
        def start(*args, _original=group.start_grad_sync, **kwargs):
            import traceback

            in_finalize = any(frame.name == "finish_grad_sync" for frame in traceback.extract_stack())
            launches.append((tasks_started[0], in_finalize))
            return _original(*args, **kwargs)
        group.start_grad_sync = start
    return launches


def run_cases(cases: list[Case]) -> list[dict]:
    """Several cases in one launch (process start-up dominates small runs on CPU)."""
    return [run_case(case) for case in cases]


def grouped_gemm_cases(cases: list[Case], te_versions: tuple[str, ...]) -> list[dict]:
    """``run_cases`` once per Transformer Engine version (the CPU stand-in, installed as it), in one launch."""
    from .te_package import install

    results = []
    for version in te_versions:
        install(version)
        results += [dict(result, te_version=version) for result in run_cases(cases)]
    return results
