"""megatron_rrfp.megatron_lm.training_loop: goodput ledger and traces around Megatron-LM's loop.

    python -m pytest tests/unit/test_megatron_lm_hooks.py -q          # a few seconds

CI has no megatron.training, so the hooks are exercised against a STAND-IN for
``megatron.training.training``, written for these tests (no Megatron-LM code): a module
object whose pretrain / train call setup_model_and_optimizer, load_checkpoint,
save_checkpoint_and_time, save_checkpoint and train_step through the module's globals, as
Megatron-LM's do (megatron_lm/layout.py, "Megatron-LM training-loop hooks"). Its train_step stands
in for the RRFP schedule by publishing a measured IterationReport with spans. The
ledger is the real SQLite one, read back through goodput_report. The last test checks
the real megatron.training.training when it is importable (a Megatron-LM checkout on
PYTHONPATH); the end-to-end run of pretrain_gpt.py is a local check (see the README).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import types
import warnings
from types import SimpleNamespace

import pytest

from megatron_rrfp.goodput import goodput_report, load_ledger
from megatron_rrfp.megatron_lm import install as integration
from megatron_rrfp.megatron_lm import layout as adapter
from megatron_rrfp.megatron_lm.training_loop import HookOptions, MegatronLMHooks, TraceWarning, trace_due
from megatron_rrfp.policy.actions import Kind, Task
from megatron_rrfp.runtime.report import IterationReport
from megatron_rrfp.trace import Span

# The stand-in (see the module docstring). ARGS, SAVED and the schedule STEP are set by
# the test; `from`-style name binding is not used inside, so every call below goes
# through this module's globals -- the property the hooks rely on.
_STAND_IN_TRAINING = textwrap.dedent('''
    import time
    _TRAIN_START_TIME = time.time() - 5.0   # the process "started" 5 s ago
    ARGS = None
    SAVED = []
    STEP = None

    def load_checkpoint(model, optimizer, scheduler, **kwargs):
        return ARGS.checkpoint_iteration, 0.0          # (iteration, flops)

    def save_checkpoint(iteration, model, optimizer, scheduler, flops, *args, **kwargs):
        if iteration in ARGS.failing_saves:
            raise OSError(f"stand-in: cannot save iteration {iteration}")
        SAVED.append(iteration)

    def save_checkpoint_and_time(iteration, model, optimizer, scheduler, flops, context, **kwargs):
        save_checkpoint(iteration, model, optimizer, scheduler, flops, context)

    def setup_model_and_optimizer(model_provider, model_type, **kwargs):
        ARGS.iteration = 0
        if ARGS.load:
            ARGS.iteration, _ = load_checkpoint(None, None, None)
        return "model", "optimizer", "scheduler"

    def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, fb, iteration=None):
        STEP(iteration)
        return {}, False, False, False, 0, 1.0, 0, None

    def train(model, optimizer, scheduler):
        iteration = ARGS.iteration
        while iteration < ARGS.train_iters:
            ARGS.curr_iteration = iteration
            train_step(None, None, model, optimizer, scheduler, None, None, iteration=iteration)
            iteration += 1
            if ARGS.save_interval and iteration % ARGS.save_interval == 0:
                save_checkpoint_and_time(iteration, model, optimizer, scheduler, 0.0, {})
        return iteration

    def pretrain(dataset_provider, model_provider, model_type, forward_step_func, **kwargs):
        model, optimizer, scheduler = setup_model_and_optimizer(model_provider, model_type)
        iteration = train(model, optimizer, scheduler)
        if ARGS.save_interval and iteration % ARGS.save_interval:   # core_v0.16.1's final save
            save_checkpoint(iteration, model, optimizer, scheduler, 0.0)
        return iteration
''')


class FakeSchedule:
    """Stands in for forward_backward_rrfp: each step publishes a fresh measured report."""

    def __init__(self, fail_at=None):
        self.report = None
        self.fail_at = fail_at  # 0-based iteration whose step raises

    def __call__(self, iteration):
        if self.fail_at is not None and iteration == self.fail_at:
            raise RuntimeError(f"stand-in schedule: stage 1 lost at iteration {iteration + 1}")
        spans = [Span(0, "0F0", "F", 0.00, 0.02), Span(0, "wait", "wait", 0.02, 0.03),
                 Span(0, "0B0", "B", 0.03, 0.07)]
        self.report = IterationReport(rank=0, stage=0, order=[Task(Kind.F, 0), Task(Kind.B, 0)], wall_s=0.07,
                                      compute_s=0.06, wait_s=0.01, spans=spans)

    def last_report(self):
        return self.report


@pytest.fixture
def training(monkeypatch):
    """The stand-in module, registered in sys.modules (the entry point is rebound there)."""
    module = types.ModuleType("stand_in_megatron_training_training")
    exec(compile(_STAND_IN_TRAINING, "<stand-in megatron.training.training>", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _args(**overrides):
    base = dict(train_iters=4, save_interval=2, log_interval=3, load=False, checkpoint_iteration=0, failing_saves=(),
                global_batch_size=8, seq_length=64, pipeline_model_parallel_size=2, tensor_model_parallel_size=1)
    return SimpleNamespace(**{**base, **overrides})


def _hooks(training, schedule, options, timers=None):
    """Hooks on the stand-in, activated; ``schedule`` runs its steps and reports them."""
    training.STEP = schedule
    hooks = MegatronLMHooks(training, get_args=lambda: training.ARGS, get_timers=lambda: timers,
                            last_report=schedule.last_report)
    hooks.attach()
    hooks.activate(options)
    return hooks


def _run(training, args):
    training.ARGS = args
    return training.pretrain(None, None, None, None)


def _events(path, kind):
    return [e for e in load_ledger(path).events if e.kind == kind]


def test_ledger_records_iterations_checkpoints_and_restart(training, tmp_path):
    from megatron.core.timers import Timers

    ledger, traces = str(tmp_path / "goodput.db"), str(tmp_path / "traces")
    schedule, timers = FakeSchedule(), Timers(1, "minmax")  # log level 1: the rrfp-* timers are real
    hooks = _hooks(training, schedule, HookOptions(ledger_path=ledger, trace_dir=traces), timers)
    try:
        assert _run(training, _args()) == 4  # saves at 2, 4 (save_checkpoint_and_time)
        _run(training, _args(load=True, checkpoint_iteration=4, train_iters=7))  # 6; final 7 direct
    finally:
        hooks.detach()

    report = goodput_report(ledger)
    assert [r.iteration for r in report.iterations] == [1, 2, 3, 4, 5, 6, 7]
    assert all(r.fate == "kept" and r.measured and r.tokens == 8 * 64 for r in report.iterations)
    assert report.sessions == 2 and report.disruptions == []
    assert report.badput["pipeline_bubble"] > 0  # the reports' wait_s reached the accounting
    saves = _events(ledger, "checkpoint_save_end")  # one per save although two functions are wrapped
    assert [(e.iteration, e.data["ok"]) for e in saves] == [(2, True), (4, True), (6, True), (7, True)]
    assert training.SAVED == [2, 4, 6, 7]
    assert [e.data["resumed_from"] for e in _events(ledger, "restart")] == [4]
    assert len(_events(ledger, "checkpoint_load_end")) == 1
    assert len(_events(ledger, "job_end")) == 2
    assert _events(ledger, "job_start")[0].data == {"world": 1, "pp": 2, "tp": 1}
    assert load_ledger(ledger).sessions[0].started_wall <= training._TRAIN_START_TIME + 1e-3  # since_wall
    assert timers("rrfp-bubble").elapsed(reset=False) == pytest.approx(7 * 0.01)
    assert "rrfp-bubble" in timers.log.names  # extend_timer_logging: training_log prints them

    # --log-interval 3 and the last iteration of each run (--train-iters 4, then 7); one
    # merged file per traced iteration (one rank here: no process group)
    assert sorted(os.listdir(traces)) == [f"rrfp-iter{n}.json" for n in (3, 4, 6, 7)]
    with open(os.path.join(traces, "rrfp-iter6.json")) as handle:
        trace = json.load(handle)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["cat"], e["pid"]) for e in spans] == [("0F0", "F", 0), ("wait", "wait", 0), ("0B0", "B", 0)]
    assert trace["otherData"]["iteration"] == 6 and trace["otherData"]["ranks"]["0"]["order"] == "0F0,0B0"


# megatron-core's Timers.write gathers with the name torch 2.13 deprecates (its own call, not ours)
@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning")
def test_rrfp_alone_puts_its_breakdown_in_megatrons_tensorboard_timers(training, tmp_path):
    """No ledger, no trace dir, default --timing-log-level 0: training_log's (empty) timer
    list still gets the rrfp-* timers, and megatron-core's Timers.write puts them in
    TensorBoard as Megatron-LM names timers (<name>-time); read back with TensorBoard's reader."""
    import torch.distributed as dist
    from megatron.core.timers import Timers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from megatron_rrfp.cpu import enable_cpu_reference_schedules

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    enable_cpu_reference_schedules()  # megatron-core's Timers gather on current_device(); CPU: a gloo group
    timers = Timers(0, "minmax")
    hooks = _hooks(training, FakeSchedule(), HookOptions(), timers)
    try:
        assert _run(training, _args(save_interval=0)) == 4
        writer = SummaryWriter(str(tmp_path / "tb"))
        timers.write([], writer, 4, normalizer=4)  # what training_log does with --log-timers-to-tensorboard
        writer.close()
    finally:
        dist.destroy_process_group()
        hooks.detach()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"rrfp-compute-time", "rrfp-bubble-time"} <= set(events.Tags()["scalars"])
    [bubble] = events.Scalars("rrfp-bubble-time")
    assert (bubble.step, bubble.value) == (4, pytest.approx(0.01))  # per iteration: 4 x 0.01 s / 4
    assert os.listdir(tmp_path) == ["tb"]  # no ledger, no traces


def test_trace_io_error_warns_once_and_training_continues(training, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the trace directory's parent should be")
    ledger = str(tmp_path / "goodput.db")
    hooks = _hooks(training, FakeSchedule(), HookOptions(ledger_path=ledger, trace_dir=str(blocker / "traces")))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _run(training, _args(train_iters=7, log_interval=1)) == 7
    finally:
        hooks.detach()
    trace_warnings = [w for w in caught if issubclass(w.category, TraceWarning)]
    assert len(trace_warnings) == 1, [str(w.message) for w in caught]
    assert "rrfp-iter1.json not written" in str(trace_warnings[0].message)
    assert [r.iteration for r in goodput_report(ledger).iterations] == list(range(1, 8))


def test_failures_are_recorded_and_reraised(training, tmp_path):
    ledger = str(tmp_path / "goodput.db")
    schedule = FakeSchedule()
    hooks = _hooks(training, schedule, HookOptions(ledger_path=ledger))
    try:
        with pytest.raises(OSError, match="cannot save iteration 2"):
            _run(training, _args(failing_saves=(2,)))
        schedule.fail_at = 2
        with pytest.raises(RuntimeError, match="stage 1 lost"):
            _run(training, _args(load=True, checkpoint_iteration=1))
    finally:
        hooks.detach()
    assert [(e.iteration, e.data["ok"]) for e in _events(ledger, "checkpoint_save_end")] == [(2, False), (2, True)]
    assert [(e.data["kind"], e.data["rank"]) for e in _events(ledger, "disruption")] == \
        [("OSError", 0), ("RuntimeError", 0)]
    assert _events(ledger, "job_end") == []
    report = goodput_report(ledger)
    assert [(r.iteration, r.fate) for r in report.iterations if r.fate != "kept"] == [(2, "wasted"), (3, "incomplete")]


def test_megatron_sys_exit_zero_is_a_clean_end(training, tmp_path):
    ledger = str(tmp_path / "goodput.db")
    hooks = _hooks(training, FakeSchedule(), HookOptions(ledger_path=ledger))
    original_train = training.train

    def train_then_exit(*args):  # Megatron's train() on --exit-interval: sys.exit(0)
        original_train(*args)
        raise SystemExit(0)

    training.train = train_then_exit
    try:
        with pytest.raises(SystemExit):
            _run(training, _args())
    finally:
        hooks.detach()
    assert len(_events(ledger, "job_end")) == 1 and _events(ledger, "disruption") == []


def test_inactive_hooks_leave_megatron_alone(training, tmp_path):
    originals = {name: getattr(training, name) for name in
                 ("pretrain", "setup_model_and_optimizer", "load_checkpoint", "save_checkpoint_and_time",
                  "save_checkpoint", "train_step")}
    by_name = types.ModuleType("stand_in_entry_script")  # `from megatron.training import pretrain`
    by_name.pretrain = training.pretrain
    sys.modules[by_name.__name__] = by_name
    try:
        training.STEP = FakeSchedule()
        hooks = MegatronLMHooks(training, get_args=lambda: training.ARGS, get_timers=lambda: None)
        hooks.attach()
        assert by_name.pretrain is training.pretrain is not originals["pretrain"]
        assert training.train_step is originals["train_step"]  # only the entry point until activated
        assert _run(training, _args()) == 4  # inert: no run, no files
        assert hooks.run is None and os.listdir(tmp_path) == []
        hooks.activate(HookOptions(ledger_path=str(tmp_path / "goodput.db")))
        assert training.train_step is not originals["train_step"]
        hooks.deactivate()
        hooks.detach()
    finally:
        del sys.modules[by_name.__name__]
    assert {name: getattr(training, name) for name in originals} == originals
    assert by_name.pretrain is originals["pretrain"]


def test_trace_due():
    due = [n for n in range(1, 11) if trace_due(n, log_interval=4, last_iteration=10)]
    assert due == [4, 8, 10]
    assert [n for n in range(1, 4) if trace_due(n, log_interval=None, last_iteration=None)] == []


# -- through install(): the flags decide, after Megatron's parser ran -------------------

_STAND_IN_ARGUMENTS = textwrap.dedent('''
    import argparse

    def add_megatron_arguments(parser):
        parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
        return parser

    def parse_args():
        parser = add_megatron_arguments(argparse.ArgumentParser(prog="stand-in", allow_abbrev=False))
        return parser.parse_args()
''')


@pytest.fixture
def megatron_training(monkeypatch, training):
    """Stand-ins for the megatron.training package, .arguments, .training and .global_vars."""
    package = types.ModuleType("megatron.training")
    package.__path__ = []
    arguments = types.ModuleType("megatron.training.arguments")
    exec(compile(_STAND_IN_ARGUMENTS, "<stand-in megatron.training.arguments>", "exec"), arguments.__dict__)
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_args = lambda: training.ARGS
    global_vars.get_timers = lambda: None
    package.pretrain = training.pretrain  # megatron/training/__init__.py re-exports it
    for name, module in (("megatron.training", package), ("megatron.training.arguments", arguments),
                         ("megatron.training.training", training), ("megatron.training.global_vars", global_vars)):
        monkeypatch.setitem(sys.modules, name, module)
    integration.uninstall()
    yield SimpleNamespace(package=package, arguments=arguments, training=training)
    integration.uninstall()


def test_install_activates_hooks_whenever_rrfp_is_selected(megatron_training, monkeypatch, tmp_path):
    training, package = megatron_training.training, megatron_training.package
    original_step = training.train_step
    integration.install()
    assert package.pretrain is training.pretrain and getattr(package.pretrain, "_rrfp_hook", False)

    def parse(*flags):
        monkeypatch.setattr(sys, "argv", ["stand-in", "--pipeline-model-parallel-size", "2", *flags])
        return megatron_training.arguments.parse_args()

    parse()  # 1f1b: Megatron alone
    assert training.train_step is original_step
    parse("--pipeline-schedule", "rrfp")
    assert training.train_step is not original_step  # rrfp alone: its rrfp-* timers
    ledger = str(tmp_path / "goodput.db")
    args = parse("--pipeline-schedule", "rrfp", "--rrfp-goodput-ledger", ledger)
    assert training.train_step is not original_step
    training.ARGS = argparse.Namespace(**{**vars(_args()), **vars(args)})
    training.STEP = FakeSchedule()  # the hooks read the real schedule's (empty) last report
    package.pretrain(None, None, None, None)  # what the entry script calls
    assert len(_events(ledger, "iteration_end")) == 4  # no RRFP report here: the real schedule did not run
    parse()  # back to 1f1b
    assert training.train_step is original_step
    integration.uninstall()
    assert not getattr(package.pretrain, "_rrfp_hook", False)


# -- the real Megatron-LM ------------------------------------------------------------------

def test_real_megatron_training_calls_the_wrapped_names_through_module_globals():
    """Each wrapped name is looked up at call time (LOAD_GLOBAL) by the function that calls it."""
    pytest.importorskip("megatron.training")
    training = adapter.megatron_training_module()
    names = adapter.TRAINING_LOOP_NAMES
    callers = {names.setup: "pretrain", names.load: names.setup, "save_checkpoint_and_time": "train",
               "save_checkpoint": "save_checkpoint_and_time", names.step: "train"}
    for name, caller in callers.items():
        assert callable(vars(training).get(name)), name
        assert name in getattr(training, caller).__code__.co_names, f"{caller} does not look up {name} globally"
    assert isinstance(adapter.train_start_time(training), float)
    get_args, get_timers = adapter.megatron_lm_globals()
    assert callable(get_args) and callable(get_timers)

    import megatron.training as package

    before = {name: getattr(training, name) for name in (*callers, names.entry)}
    hooks = MegatronLMHooks(training, get_args=get_args, get_timers=get_timers)
    hooks.attach()
    hooks.activate(HookOptions(trace_dir="unused"))
    try:
        assert package.pretrain is training.pretrain is not before[names.entry]
        assert all(getattr(training, name) is not before[name] for name in callers)
    finally:
        hooks.detach()
    assert {name: getattr(training, name) for name in before} == before
    assert package.pretrain is before[names.entry]


# -- Megatron-LM's CUDA graphs and paged stash under rrfp: refused at start, in one line ----------
#
# Every training CUDA graph Megatron-LM builds (core_v0.16.1 - 0.19) replays an order fixed before
# the run, and the paged stash replays the order it recorded; rrfp decides its order at run time.
# The refusal happens right after Megatron-LM's parser (megatron_lm/flags.py), before any rank
# builds a process group. The namespaces below carry what each release's parser yields.

def _rrfp_args(pp=2, schedule="rrfp", **megatron_flags):
    from megatron_rrfp.megatron_lm.flags import add_rrfp_arguments

    args = add_rrfp_arguments(argparse.ArgumentParser()).parse_args(["--pipeline-schedule", schedule])
    for name, value in {"pipeline_model_parallel_size": pp, **megatron_flags}.items():
        setattr(args, name, value)
    return args


def _scope(name):
    from megatron.core.transformer.enums import CudaGraphScope  # both wheels: 0.19 keeps it, deprecated

    return CudaGraphScope[name]


# (what the flags resolve to, the namespace): 0.16.1 has cuda_graph_scope (CudaGraphScope members, or
# "full"), 0.19 has cuda_graph_modules and --cuda-graph-scope's cuda_graph_scope_deprecated
CUDA_GRAPH_CASES = {
    "0.16-local-full-iteration": ("full_iteration", dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])),
    "0.16-enable-full-iteration": ("full_iteration", dict(cuda_graph_impl="none", enable_cuda_graph=True,
                                                          cuda_graph_scope=["full_iteration"])),
    "0.16-scope-without-impl": ("none", dict(cuda_graph_impl="none", cuda_graph_scope=["full_iteration"])),
    "0.16-local-per-layer": ("local", dict(cuda_graph_impl="local", cuda_graph_scope="full")),
    "0.16-te-attn": ("transformer_engine", dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"])),
    "0.16-external": ("transformer_engine", dict(cuda_graph_impl="none", external_cuda_graph=True,
                                                 cuda_graph_scope=[])),
    "0.19-full-iteration": ("full_iteration", dict(cuda_graph_impl="full_iteration", cuda_graph_modules=[])),
    "0.19-modules-full-iteration": ("full_iteration", dict(cuda_graph_impl="none",
                                                           cuda_graph_modules=["attn", "full_iteration"])),
    "0.19-scope-full-iteration": ("full_iteration", dict(cuda_graph_impl="none", cuda_graph_modules=[],
                                                         cuda_graph_scope_deprecated=["full_iteration"])),
    "0.19-local": ("local", dict(cuda_graph_impl="local", cuda_graph_modules=[])),
    "0.19-none": ("none", dict(cuda_graph_impl="none", cuda_graph_modules=[], cuda_graph_scope_deprecated=None,
                               optimizer_cuda_graph=True)),
}


@pytest.mark.parametrize("case", list(CUDA_GRAPH_CASES))
def test_cuda_graphs_are_refused_under_rrfp_in_one_line_naming_the_flag(case):
    from megatron_rrfp.megatron_lm.flags import cuda_graph_capture, validate_rrfp_arguments

    expected, flags = CUDA_GRAPH_CASES[case]
    flags = {k: [_scope(s) if s in ("full_iteration", "attn") and k == "cuda_graph_scope" else s for s in v]
             if isinstance(v, list) else v for k, v in flags.items()}
    args = _rrfp_args(**flags)
    impl, given = cuda_graph_capture(args)
    assert impl == expected, (impl, given)
    if expected == "none":
        assert validate_rrfp_arguments(args) is not None  # inference-only / optimizer graphs: accepted
        return
    with pytest.raises(ValueError) as refused:
        validate_rrfp_arguments(args)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--pipeline-schedule rrfp does not support {given}:")
    assert given and given.split()[0] in {"--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph",
                                          "--cuda-graph-modules", "--cuda-graph-scope"}
    reason = {"full_iteration": "FullCudaGraphWrapper", "local": "per-layer graphs",
              "transformer_engine": "TECudaGraphHelper"}[expected]
    assert reason in message and message.endswith("or use --pipeline-schedule 1f1b")
    assert validate_rrfp_arguments(_rrfp_args(schedule="1f1b", **flags)) is None  # 1f1b: Megatron's, unchanged
    assert validate_rrfp_arguments(_rrfp_args(pp=1, **flags)) is not None  # PP=1 runs Megatron's own schedule


@pytest.mark.parametrize("flag, value, reason", [("moe_paged_stash", True, "order of forward and backward"),
                                                 ("moe_expert_rank_capacity_factor", 1.5, "PagedStashRunner")])
def test_paged_stash_is_refused_under_rrfp(flag, value, reason):
    from megatron_rrfp.megatron_lm.flags import validate_rrfp_arguments

    with pytest.raises(ValueError, match=rf"^--pipeline-schedule rrfp does not support --{flag.replace('_', '-')}: "
                                         rf".*{reason}.*or use --pipeline-schedule 1f1b$"):
        validate_rrfp_arguments(_rrfp_args(**{flag: value}))
    assert validate_rrfp_arguments(_rrfp_args(schedule="1f1b", **{flag: value})) is None


def test_uneven_pipeline_layout_is_accepted_and_interleaved_only_where_verified():
    """--pipeline-model-parallel-layout: the executor runs the chunks Megatron builds, whatever their
    layer counts (Megatron-LM's pretrain_gpt.py, 1 and 3 layers: test_megatron_lm_e2e.py); more
    stages than ranks only on the megatron-core releases where its losses were checked."""
    from megatron_rrfp.mcore.compat import interleaved_layout_unverified
    from megatron_rrfp.megatron_lm.flags import validate_rrfp_arguments

    assert validate_rrfp_arguments(_rrfp_args(pipeline_model_parallel_layout="Et|tttL")) is not None
    interleaved = _rrfp_args(pipeline_model_parallel_layout="E|tt|t|tL")
    if not interleaved_layout_unverified():
        assert validate_rrfp_arguments(interleaved) is not None
        return
    with pytest.raises(ValueError, match=r"^--pipeline-schedule rrfp does not support --pipeline-model-parallel-"
                                         r"layout 'E\|tt\|t\|tL' \(4 stages on 2 pipeline ranks\): .*1f1b$"):
        validate_rrfp_arguments(interleaved)
    assert validate_rrfp_arguments(_rrfp_args(schedule="1f1b", pipeline_model_parallel_layout="E|tt|t|tL")) is None


REAL_PARSER_REFUSALS = [  # Megatron-LM 0.19's own spellings, through its own parser
    (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl full_iteration", "FullCudaGraphWrapper"),
    (["--cuda-graph-modules", "full_iteration"], "--cuda-graph-modules full_iteration", "FullCudaGraphWrapper"),
    (["--cuda-graph-impl", "local"], "--cuda-graph-impl local", "per-layer graphs"),
    (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "mlp"],
     "--cuda-graph-impl transformer_engine", "TECudaGraphHelper"),
    (["--enable-cuda-graph"], "--enable-cuda-graph", "per-layer graphs"),
    (["--moe-expert-rank-capacity-factor", "1.25"], "--moe-expert-rank-capacity-factor", "PagedStashRunner"),
    (["--moe-paged-stash", "--moe-expert-rank-capacity-factor", "1.25"], "--moe-paged-stash", "order of forward"),
]


@pytest.mark.parametrize("flags, named, reason", REAL_PARSER_REFUSALS, ids=[r[1] for r in REAL_PARSER_REFUSALS])
def test_real_megatron_parser_refuses_in_one_line_before_any_rank_starts(monkeypatch, capsys, flags, named, reason):
    """install() hooks Megatron-LM's real parser; its parse_args exits 2 with one line on stderr."""
    arguments = pytest.importorskip("megatron.training.arguments")
    if not hasattr(arguments, "_parse_cuda_graph_modules_arg"):
        pytest.skip("Megatron-LM before 0.19: the 0.19 spellings")
    integration.uninstall()
    integration.install()
    try:
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--pipeline-model-parallel-size", "2", *flags,
                                          "--pipeline-schedule", "rrfp"])
        with pytest.raises(SystemExit) as exited:
            arguments.parse_args()
        assert not integration.routed()
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--pipeline-model-parallel-size", "2", *flags])
        assert arguments.parse_args().pipeline_schedule == "1f1b"  # the same flags with 1f1b: Megatron's
    finally:
        integration.uninstall()
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"error: --pipeline-schedule rrfp does not support {named}: " in lines[0] and reason in lines[0]


def test_real_megatron_training_wraps_the_schedule_under_the_refused_flags():
    """Why the refusals: Megatron-LM's train() wraps what get_forward_backward_func returns in
    FullCudaGraphWrapper (--cuda-graph-impl full_iteration; 0.16.1: local + full_iteration scope)
    and, from 0.19, in PagedStashRunner (--moe-expert-rank-capacity-factor)."""
    import inspect

    pytest.importorskip("megatron.training")
    source = inspect.getsource(adapter.megatron_training_module().train)
    assert "FullCudaGraphWrapper(" in source and "full_iteration" in source
    if "PagedStashRunner" in vars(adapter.megatron_training_module()):
        assert "PagedStashRunner(" in source and "moe_expert_rank_capacity_factor" in source
