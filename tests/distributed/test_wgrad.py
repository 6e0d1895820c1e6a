"""B/W split of megatron-core linears (megatron_rrfp.split.megatron_linear) against the unsplit backward.

    python -m pytest tests/distributed/test_wgrad.py -q -s       # ~1 min on 2 cores; -s prints memory

Each case builds the same stage twice (same seed), runs several microbatches through
the plain backward on one copy and, on the other, B of every microbatch under
``store.deferring`` in one order and W (``store.run``) in a different order, then
compares every parameter gradient (param.grad, or main_grad under megatron DDP) and the
input gradients B produced. Rank functions are top-level: they are pickled into 'spawn'
children.
"""
from __future__ import annotations

import contextlib

import pytest

from helpers import mlp
from megatron_rrfp.launch.function import launch

SEQ, MBS, VOCAB, MICROBATCHES = 16, 2, 64, 4
B_ORDER = [2, 0, 3, 1]
W_ORDER = [1, 3, 0, 2]
TOL = 1e-6


# --------------------------------------------------------------------------- rank side


def _build(kind: str, ddp: str, *, pre_process: bool):
    """(stage, model-to-call, run-microbatch) for kind 'gpt' | 'mlp' and ddp '' | 'ddp' | 'overlap'."""
    import torch

    from megatron_rrfp.train import models

    config = models.tiny_gpt_config()
    if kind == "gpt":
        stage = models.build_gpt_stage(config, vocab_size=VOCAB, seq_length=SEQ, seed=1,
                                       pre_process=pre_process, post_process=True)
    else:
        stage = mlp.build_mlp_stage(config, seed=1, pre_process=pre_process, post_process=True)
    model = stage
    if ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(overlap_grad_reduce=ddp == "overlap"), stage)
    hidden = config.hidden_size
    if kind == "gpt":
        data = models.synthetic_gpt_batches(seed=3, micro_batch_size=MBS, seq_length=SEQ, vocab_size=VOCAB)
    else:
        data = mlp.synthetic_mlp_batches(seed=3, micro_batch_size=MBS, seq_length=SEQ, hidden_size=hidden)
    batches = [next(data) for _ in range(MICROBATCHES)]
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(SEQ, MBS, hidden, generator=gen) for _ in range(MICROBATCHES)]
    return stage, model, batches, inputs


def _forward(kind, stage, model, batch, hidden_in):
    """Loss of one microbatch; ``hidden_in`` (leaf, requires grad) feeds a stage without embedding."""
    import torch

    if hidden_in is not None:
        stage.set_input_tensor(hidden_in)
    if kind == "gpt":
        tokens = batch["tokens"] if stage.pre_process else None
        out = model(tokens, batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return out.sum()
    out = model(batch["inputs"] if stage.pre_process else None)
    return torch.sum((out - batch["targets"]) ** 2)


def _backward(stage, loss, hidden_in) -> None:
    """A stage fed by set_input_tensor runs megatron-core's own backward_step (the path
    the executor takes: custom_backward, as deallocate_pipeline_outputs is on)."""
    if hidden_in is None:
        loss.backward()
        return
    from megatron_rrfp.mcore import compat as adapter

    (grad,) = adapter.backward_step([hidden_in], [loss], [None], adapter.model_type(stage), stage.config)
    assert grad is hidden_in.grad


def _grads(stage) -> dict:
    out = {}
    for name, p in stage.named_parameters():
        g = p.main_grad if hasattr(p, "main_grad") else p.grad
        out[name] = None if g is None else g.detach().clone()
    return out


def _rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _iterations(ddp: str) -> int:
    return 2 if ddp else 1  # the second one checks DDP's state after zero_grad_buffer


def _reference(kind, ddp, pre_process):
    """Plain backward of every microbatch in order; under DDP as megatron's schedule does:
    no_sync for all but the last, then finish_grad_sync. Returns per-iteration grads."""
    import contextlib

    stage, model, batches, inputs = _build(kind, ddp, pre_process=pre_process)
    grads, input_grads = [], []
    for _ in range(_iterations(ddp)):
        if ddp:
            model.zero_grad_buffer()
        input_grads = []
        for mb in range(MICROBATCHES):
            sync = model.no_sync() if ddp and mb < MICROBATCHES - 1 else contextlib.nullcontext()
            hidden = None if pre_process else inputs[mb].clone().requires_grad_()
            with sync:
                _backward(stage, _forward(kind, stage, model, batches[mb], hidden), hidden)
            input_grads.append(None if hidden is None else hidden.grad.clone())
        if ddp:
            model.finish_grad_sync()
        grads.append(_grads(stage))
    return grads, input_grads


def _split(kind, ddp, pre_process):
    """F of every microbatch, B in B_ORDER under deferring, W in W_ORDER; under DDP all
    B and W inside no_sync (wgrad's contract), then finish_grad_sync."""
    import contextlib

    from megatron_rrfp.split import megatron_linear as wgrad

    stage, model, batches, inputs = _build(kind, ddp, pre_process=pre_process)
    wgrad.install([model])
    wgrad.install([model])  # idempotent
    from megatron_rrfp.split.coverage import coverage

    report = coverage([model])
    prefix = "model[0].module." if ddp else "model[0]."
    deferred = {name.removeprefix(prefix) for name in report.deferred}
    store = wgrad.WeightGradStore()
    no_sync = model.no_sync if ddp else contextlib.nullcontext
    grads, bytes_after_b, deferred_untouched = [], [], True
    adds_in_b = _watch_ddp_adds_in_b(stage, deferred) if ddp == "overlap" else None
    for _ in range(_iterations(ddp)):
        if ddp:
            model.zero_grad_buffer()
        hiddens, losses = {}, {}
        for mb in range(MICROBATCHES):
            hiddens[mb] = None if pre_process else inputs[mb].clone().requires_grad_()
            losses[mb] = _forward(kind, stage, model, batches[mb], hiddens[mb])
        bytes_after_b = []
        with no_sync():
            for mb in B_ORDER:
                with store.deferring((mb, 0)):
                    _backward(stage, losses.pop(mb), hiddens[mb])
                bytes_after_b.append(store.pending_bytes())
            for name, g in _grads(stage).items():  # nothing reached the deferred weights in B
                if name in deferred and g is not None and bool(g.abs().max() > 0):
                    deferred_untouched = False
            for mb in W_ORDER:
                store.run((mb, 0))
        if ddp:
            from megatron_rrfp.mcore.compat import start_unissued_grad_syncs

            start_unissued_grad_syncs([model])  # what the executor's finalize does first (0.15: see there)
            model.finish_grad_sync()
        grads.append(_grads(stage))
    return {
        "grads": grads,
        "input_grads": [None if hiddens[mb] is None else hiddens[mb].grad.clone() for mb in range(MICROBATCHES)],
        "bytes_after_b": bytes_after_b, "bytes_after_w": store.pending_bytes(), "pending_after_w": store.pending(),
        "peak": store.peak_pending_bytes, "deferred": report.deferred, "in_backward": report.in_backward,
        "deferred_untouched": deferred_untouched, "ddp_adds_in_b": None if adds_in_b is None else sum(adds_in_b),
    }


def _watch_ddp_adds_in_b(stage, deferred) -> list:
    """Under overlapped DDP: how often DDP's hook, in a deferred B, would add something into a
    deferred weight's main_grad (a gradient there and grad_added_to_main_grad off) — the
    placeholder pass the split must not make. A pre-hook on the weight's AccumulateGrad registered
    after the split's own runs after it, just before DDP's hook."""
    import torch

    from megatron_rrfp.split import store as wgrad_store

    adds = []
    for name, param in stage.named_parameters():
        if name not in deferred:
            continue
        with torch.enable_grad():
            node = param.view_as(param).grad_fn.next_functions[0][0]

        def prehook(grad_outputs, param=param):
            if wgrad_store._active is not None:
                has = grad_outputs[0] is not None or param.grad is not None
                adds.append(int(has and not param.grad_added_to_main_grad))
        node.register_prehook(prehook)
    return adds


def compare_split(cases: list[tuple[str, str, bool]]) -> list[dict]:
    """For each (kind, ddp, pre_process): max relative gradient error and the split's facts."""
    from megatron_rrfp.cpu import enable_cpu_reference_schedules

    enable_cpu_reference_schedules()
    results = []
    for kind, ddp, pre_process in cases:
        ref_iterations, ref_input_grads = _reference(kind, ddp, pre_process)
        split = _split(kind, ddp, pre_process)
        missing, errors = [], {}
        for iteration, (ref_grads, split_grads) in enumerate(zip(ref_iterations, split["grads"], strict=True)):
            for n, g in ref_grads.items():
                if g is not None and split_grads[n] is None:
                    missing.append(n)
                elif g is not None:
                    errors[f"{n} (iteration {iteration})"] = _rel_err(split_grads[n], g)
        same_inputs = all((a is None and b is None) or bool((a == b).all())
                          for a, b in zip(split.pop("input_grads"), ref_input_grads))
        split.pop("grads")
        results.append(dict(split, case=(kind, ddp, pre_process), missing=missing, max_err=max(errors.values()),
                            worst=max(errors, key=errors.get), num_grads=len(errors),
                            has_input_grads=ref_input_grads[0] is not None, same_input_grads=same_inputs))
    return results


def store_contract() -> dict:
    """Errors and max_pending on an MLP stage (single process)."""
    import torch

    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.split import megatron_linear as wgrad

    enable_cpu_reference_schedules()
    stage, model, batches, _ = _build("mlp", "", pre_process=True)
    wgrad.install([model])
    out = {}
    for bad in ((0,), [0, 0], (0, "a")):
        try:
            wgrad.WeightGradStore().run(bad)
        except TypeError:
            out.setdefault("bad_keys_rejected", 0)
            out["bad_keys_rejected"] += 1
    store = wgrad.WeightGradStore(max_pending=1)
    loss0, loss1 = (_forward("mlp", stage, model, batches[mb], None) for mb in range(2))
    with store.deferring((0, 0)):
        loss0.backward()
    with store.deferring((1, 0)):  # store full: this one runs unsplit
        loss1.backward()
    out["pending_with_limit"] = store.pending()
    out["fc1_grad_after_inline"] = stage.blocks[0].fc1.weight.grad is not None
    try:
        with store.deferring((0, 0)):
            pass
    except ValueError as exc:
        out["duplicate"] = str(exc)
    try:
        store.run((5, 0))
    except KeyError as exc:
        out["unknown"] = str(exc)
    store.run((1, 0))  # no-op: computed inline
    store.run((0, 0))
    out["pending_end"] = store.pending()
    out.update(_ddp_refusals())
    # A saved tensor modified in place between B and W is detected, not silently used.
    x = torch.randn(SEQ, MBS, 32)
    loss = _forward("mlp", stage, model, {"inputs": x, "targets": torch.zeros_like(x)}, None)
    with store.deferring((2, 0)):
        loss.backward()
    x.add_(1.0)
    try:
        store.run((2, 0))
    except RuntimeError as exc:
        out["in_place"] = str(exc)
    return out


def _ddp_refusals() -> dict:
    """overlap_grad_reduce DDP: B or W with sync enabled is refused; main_grad without DDP too."""
    from megatron_rrfp.split import megatron_linear as wgrad

    out = {}
    stage, model, batches, _ = _build("mlp", "overlap", pre_process=True)
    wgrad.install([model])
    store = wgrad.WeightGradStore()
    loss = _forward("mlp", stage, model, batches[0], None)
    try:
        with store.deferring((0, 0)):
            loss.backward()
    except RuntimeError as exc:
        out["b_with_sync"] = str(exc)
    out["pending_after_refused_b"] = store.pending()
    with model.no_sync():
        with store.deferring((1, 0)):
            _forward("mlp", stage, model, batches[1], None).backward()
    try:
        store.run((1, 0))
    except RuntimeError as exc:
        out["w_with_sync"] = str(exc)
    with model.no_sync():
        store.run((1, 0))  # still pending after the refusal, nothing was accumulated
    out["pending_after_w"] = store.pending()

    plain, _, _, _ = _build("mlp", "", pre_process=True)
    plain.blocks[0].fc1.weight.main_grad = plain.blocks[0].fc1.weight.detach().clone()
    try:
        wgrad.install([plain])
    except ValueError as exc:
        out["orphan_main_grad"] = str(exc)
    return out


def sequence_parallel_installs() -> list[str]:
    """Sequence parallelism is no longer a blocker (W re-gathers the saved local input); the
    split's equivalence under SP is tests/distributed/test_executor.py's TP2xPP2 case."""
    from megatron_rrfp.split import megatron_linear as wgrad
    from megatron_rrfp.train import models

    config = models.tiny_gpt_config(sequence_parallel=True)
    stage = mlp.build_mlp_stage(config, seed=1)
    wgrad.install([stage])
    return wgrad.deferral_blockers([stage])


def sequence_parallel_w_regathers() -> dict:
    """An SP column-parallel linear split: B's store holds only the local input and the
    output gradient (not the TP-gathered input), and W's re-gather gives the unsplit
    weight gradient."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel import layers as mlayers

    from megatron_rrfp.split import megatron_linear as wgrad
    from megatron_rrfp.train import models

    gathers = {"n": 0}
    real_gather = mlayers.dist_all_gather_func

    def counting_gather(*args, **kwargs):  # wraps megatron's gather from outside: what B and W issue
        gathers["n"] += 1
        return real_gather(*args, **kwargs)

    config = models.tiny_gpt_config(sequence_parallel=True)
    hidden, tp = config.hidden_size, torch.distributed.get_world_size()
    gen = torch.Generator().manual_seed(5 + torch.distributed.get_rank())
    x = torch.randn(SEQ // tp, MBS, hidden, generator=gen)  # this rank's sequence shard
    grads = []
    for split in (False, True):
        torch.manual_seed(1)
        linear = ColumnParallelLinear(hidden, 4 * hidden, config=config, init_method=config.init_method,
                                      bias=False, gather_output=False)
        store = wgrad.WeightGradStore()
        if split:
            wgrad.install([linear])
        inputs = x.clone().requires_grad_()
        out, _ = linear(inputs)
        g = torch.ones_like(out)
        gathers["n"] = 0
        mlayers.dist_all_gather_func = counting_gather
        try:
            with store.deferring((0, 0)) if split else contextlib.nullcontext():
                out.backward(g)
            gathers_in_b = gathers["n"]
            if split:
                held = store.pending_bytes()
                deferred_before_w = linear.weight.grad is None
                store.run((0, 0))
        finally:
            mlayers.dist_all_gather_func = real_gather
        if split:
            gathers_split = (gathers_in_b, gathers["n"] - gathers_in_b)
        grads.append(linear.weight.grad.clone())
    local = x.numel() * x.element_size()
    return {"held": held, "expected": local + g.numel() * g.element_size(), "gathered": tp * local,
            "deferred": deferred_before_w, "max_err": float((grads[0] - grads[1]).abs().max()),
            "gathers_b_w": gathers_split}


def _break_split_contract() -> None:
    """Stand in for a megatron-core release whose linear backward no longer goes through
    the module-level prepare_input_tensors_for_wgrad_compute (same gradients, unsplit):
    the original backward, run with that name pointing at megatron.core.utils' own."""
    from megatron.core import utils
    from megatron.core.tensor_parallel import layers

    function = layers.LinearWithGradAccumulationAndAsyncCommunication
    original = function.backward

    def backward(ctx, grad_output):
        seen = layers.prepare_input_tensors_for_wgrad_compute
        layers.prepare_input_tensors_for_wgrad_compute = utils.prepare_input_tensors_for_wgrad_compute
        try:
            return original(ctx, grad_output)
        finally:
            layers.prepare_input_tensors_for_wgrad_compute = seen

    function.backward = staticmethod(backward)


def split_fallback_suite() -> dict:
    """PP=2 GPT with the split contract broken before anything is built: the default hint
    against megatron's 1F1B (printed line captured), then an explicit zbh1 hint."""
    import contextlib
    import io

    import torch.distributed as dist

    from helpers import equivalence
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp
    from megatron_rrfp.mcore.session import shutdown
    from megatron_rrfp.split import megatron_linear as wgrad
    from megatron_rrfp.train import models

    _break_split_contract()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        default = equivalence.run_case(equivalence.Case(model="gpt", iterations=2, hint="default"))
    case = equivalence.Case(model="gpt", hint="zbh1")
    model = equivalence._build(case, data_parallel=1)
    forwards = []

    def forward_step(data_iterator, model):
        forwards.append(1)
        return models.gpt_forward_step(data_iterator, model)

    zbh1_error = ""
    try:
        forward_backward_rrfp(forward_step_func=forward_step, data_iterator=equivalence._data(case, 0), model=model,
                              num_microbatches=case.num_microbatches, seq_length=case.seq_length,
                              micro_batch_size=case.micro_batch_size, rrfp_config=RRFPConfig.of(hint="zbh1"))
    except NotImplementedError as exc:
        zbh1_error = str(exc)
    dist.barrier()  # both ranks got here: the refusal did not leave a peer waiting
    shutdown()
    return {"default": default, "printed": printed.getvalue(), "zbh1_error": zbh1_error,
            "forwards_before_error": len(forwards), "self_check": wgrad.split_self_check()}


def single_process_suite(cases) -> dict:
    return {"compare": compare_split(cases), "contract": store_contract()}


def tp2_suite(cases) -> dict:
    return {"compare": compare_split(cases), "sequence_parallel": sequence_parallel_installs(),
            "sp_regather": sequence_parallel_w_regathers()}


# --------------------------------------------------------------------------- tests
#
# Two launches only: starting a rank (imports, gloo) costs more than the checks.


def _check(results: list[dict]) -> None:
    for r in results:
        assert not r["missing"], r
        assert r["max_err"] <= TOL, (r["case"], r["worst"], r["max_err"])
        assert r["deferred_untouched"], r["case"]
        assert all(b > 0 for b in r["bytes_after_b"]), r
        assert r["bytes_after_b"] == sorted(r["bytes_after_b"]) and r["peak"] == r["bytes_after_b"][-1]
        assert r["bytes_after_w"] == 0 and r["pending_after_w"] == []
        assert r["same_input_grads"], r["case"]  # B's input gradients are bitwise the unsplit ones
        assert r["ddp_adds_in_b"] in (None, 0), r  # no placeholder pass into main_grad in B


@pytest.mark.timeout(150)
def test_split_equals_unsplit_gpt_mlp_plain_and_ddp_and_store_contract():
    cases = [("gpt", "", True), ("gpt", "", False), ("gpt", "ddp", True), ("gpt", "overlap", False),
             ("mlp", "", False), ("mlp", "ddp", True), ("mlp", "overlap", False)]
    out = launch(single_process_suite, world_size=1, timeout=140, args=(cases,))[0]
    results = out["compare"]
    _check(results)
    assert any(r["has_input_grads"] for r in results)
    gpt = next(r for r in results if r["case"] == ("gpt", "", True))
    # 2 layers x (qkv, proj, fc1, fc2) + output layer; the rest (norms, biases, embeddings) in B.
    assert len(gpt["deferred"]) == 9, gpt["deferred"]
    assert {kind for _, kind in gpt["in_backward"]} >= {"VocabParallelEmbedding", "Embedding"}
    print(f"\n[wgrad] tiny GPT (h=32, ffn=64, 2 layers, vocab {VOCAB}, seq {SEQ}, mbs {MBS}, fp32): "
          f"{gpt['bytes_after_b'][0]} bytes held per deferred microbatch; peak {gpt['peak']} "
          f"with {MICROBATCHES} pending")

    contract = out["contract"]
    assert contract["bad_keys_rejected"] == 3
    assert contract["pending_with_limit"] == [(0, 0)] and contract["fc1_grad_after_inline"]
    assert "already deferred" in contract["duplicate"] and "no deferred B" in contract["unknown"]
    assert contract["pending_end"] == [] and "modified in place" in contract["in_place"]
    assert "gradient sync enabled" in contract["b_with_sync"] and contract["pending_after_refused_b"] == []
    assert "gradient sync enabled" in contract["w_with_sync"] and contract["pending_after_w"] == []
    assert "fc1.weight" in contract["orphan_main_grad"]


@pytest.mark.timeout(150)
def test_tp2_split_equals_unsplit_and_sequence_parallel_is_no_blocker():
    cases = [("gpt", "", True), ("gpt", "ddp", False), ("mlp", "", False)]
    outs = launch(tp2_suite, world_size=2, tp=2, pp=1, timeout=140, args=(cases,))
    for out in outs:
        _check(out["compare"])
        assert not any("sequence" in b for b in out["sequence_parallel"]), out["sequence_parallel"]
        sp = out["sp_regather"]  # B kept the local input + output gradient only; W re-gathered
        assert sp["deferred"] and sp["held"] == sp["expected"] and sp["max_err"] <= TOL, sp
        assert sp["gathers_b_w"] == (0, 1), sp  # B issues no all-gather nobody uses; W one


def test_default_policy_splits_the_backward_only_where_every_stage_can():
    """with_split_capability: a model with no megatron-core linear to defer (here plain
    torch layers, as with Transformer Engine ones) keeps the default hint unsplit, and so
    does a stage whose neighbour cannot split (the pipeline-wide AND); other hints are
    left as given."""
    import torch

    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.stage_work import with_split_capability
    from megatron_rrfp.split import megatron_linear as wgrad

    plain = [torch.nn.Sequential(torch.nn.Linear(4, 4))]
    assert any("no trainable megatron-core" in b for b in wgrad.deferral_blockers(plain))
    unsplit = with_split_capability(RRFPConfig(), plain, all_stages=lambda ok: ok)
    assert unsplit.arbiter.split_backward_ok is False
    neighbour_blocked = with_split_capability(RRFPConfig(), [torch.nn.Sequential(torch.nn.Linear(4, 4))],
                                              all_stages=lambda ok: False)
    assert neighbour_blocked.arbiter.split_backward_ok is False
    explicit = RRFPConfig.of(hint="bf")
    assert with_split_capability(explicit, plain, all_stages=lambda ok: ok) is explicit


@pytest.mark.timeout(200)
def test_broken_split_contract_falls_back_for_default_and_refuses_zbh1():
    """A megatron-core whose linear backward the split cannot intercept (simulated from the
    rank function, before the model is built): the install-time self-check finds it; the
    default hint then trains unsplit with one line naming the version and reason, with
    megatron 1F1B's gradients; zbh1 is refused before any forward, naming --rrfp-hint."""
    outs = launch(split_fallback_suite, world_size=2, pp=2, timeout=190)
    for out in outs:
        assert "self-check failed" in out["self_check"] and "megatron-core 0." in out["self_check"]
        default = out["default"]
        assert default["grad_rel_err"] <= 1e-5 and default["loss_rel_err"] <= 1e-5, default
        assert default["peak_deferred_wgrad_bytes"] == 0 and not any("W" in o for o in default["orders"])
        lines = [line for line in out["printed"].splitlines() if "without the B/W split" in line]
        assert len(lines) == 1 and out["self_check"] in lines[0], out["printed"]
        assert out["forwards_before_error"] == 0
        error = out["zbh1_error"]
        assert "'zbh1'" in error and "--rrfp-hint" in error and "default" in error and out["self_check"] in error
    print(f"\n[wgrad] fallback line: {lines[0]}\n[wgrad] zbh1: {error}")
