"""Every bad value is refused before anything starts: random out-of-range, non-finite and
non-numeric values of every numeric flag of ``simulate``, ``bench``, ``demo``, ``train`` and
``goodput``, and random malformed hint files (JSON and CSV, wrong encodings), go through
the real entry point (``megatron_rrfp.cli.main``, in process) and must give exit status 2,
one line on stderr naming the flag (and its accepted range) or the file, no traceback, no
process started, in well under 5 s."""
from __future__ import annotations

import json
import multiprocessing.process
import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rrfp.bench.run import BenchConfig
from megatron_rrfp.checks import BUFFER_LIMIT, TIMEOUT_S, Bound, LimitBound
from megatron_rrfp.cli import main
from megatron_rrfp.goodput.cli import BINS
from megatron_rrfp.sim import cli as sim_cli
from megatron_rrfp.sim import llava
from megatron_rrfp.sim.study import StudyConfig
from megatron_rrfp.sim.variability import Variability
from megatron_rrfp.train import config as train_config

pytestmark = pytest.mark.timeout(120)


def _flags(bounds: dict[str, Bound], flags: dict[str, str]) -> list[tuple[str, Bound]]:
    return [(flags[name], bound) for name, bound in bounds.items() if name in flags]


_WORKLOAD = _flags(Variability.BOUNDS, Variability.FLAGS)
_SIM_ONLY = {"--sigma-compute", "--backward-ratio", "--c50", "--sigma-msg"}
_LLAVA = list(llava.BOUNDS.items())  # bench and demo: their own --seq-length / --hidden-size
_WORKLOAD_BENCH = [f for f in _WORKLOAD if f[0] not in _SIM_ONLY] + [f for f in _LLAVA
                                                                     if f[0] not in llava.MODEL_SIZE_FLAGS]
NUMERIC_FLAGS = {
    "simulate": _flags(StudyConfig.BOUNDS, StudyConfig.FLAGS) + _WORKLOAD + _LLAVA
    + [("--optimal-time-limit", sim_cli.OPTIMAL_TIME_LIMIT)],
    "bench": _flags(BenchConfig.BOUNDS, BenchConfig.FLAGS) + _WORKLOAD_BENCH,
    "demo": _flags(BenchConfig.BOUNDS, BenchConfig.FLAGS) + _WORKLOAD_BENCH,
    "train": _flags(train_config.BOUNDS, train_config.FLAGS) + [("--rrfp-buffer-limit", BUFFER_LIMIT),
                                                                ("--rrfp-timeout", TIMEOUT_S)],
    "goodput": [("--bins", BINS)],
    "compare": [],  # two JSON files, no numbers
}
# what each command needs besides the bad flag (valid, and nothing that would start work first)
BASE_ARGS = {"goodput": ["no-such-ledger.db"], "train": ["--cpu", "--nproc", "2", "--pipeline-model-parallel-size", "2",
                                                         "--pipeline-schedule", "rrfp"]}


class NoProcesses:
    """Any attempt to start a process or rank fails the test (the code catches only
    ValueError / OSError, so an AssertionError surfaces)."""

    def __enter__(self):
        self.patch = pytest.MonkeyPatch()

        def refuse(*args, **kwargs):
            raise AssertionError(f"a process was started: {args!r:.200}")

        self.patch.setattr(subprocess, "Popen", refuse)
        self.patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        self.patch.setattr(os, "fork", refuse)
        self.patch.setattr(os, "posix_spawn", refuse)
        self.patch.setattr("megatron_rrfp.launch.function.launch", refuse)
        self.patch.setattr("megatron_rrfp.launch.torchrun.run_module", refuse)
        return self

    def __exit__(self, *exc):
        self.patch.undo()


def run_cli(argv: list[str], capsys) -> tuple[int, str, str, float]:
    capsys.readouterr()
    start = time.monotonic()
    with NoProcesses():
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own exit
            code = exc.code
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    return code, out, err, elapsed


def assert_refused(code, out, err, elapsed, *, names: str, also: str = "") -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err and "error:" in lines[0], err
    assert names in lines[0], (names, lines[0])
    assert also in lines[0], (also, lines[0])
    assert out == "", out
    assert elapsed < 5.0, elapsed


# -- random values of every numeric flag -----------------------------------------------

def _bad_values(bound: Bound) -> st.SearchStrategy[str]:
    if isinstance(bound, LimitBound):  # an integer >= 1, a positive multiple "kx", or "auto"
        bad = ["nan", "inf", "0", "-3", "0x", "-1x", "x", "1.5", "nanx", "autox", "", "2 x y"]
        return st.one_of(st.sampled_from(bad), st.integers(max_value=0).map(str))
    kinds = [st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1e999", "", " ", "0x10", "1,5"])]
    if bound.low is not None:
        kinds.append(st.floats(max_value=bound.low, exclude_max=not bound.low_open, allow_nan=False,
                               allow_infinity=False).map(lambda v: str(int(v)) if bound.integer and v.is_integer()
                                                         and abs(v) < 1e18 else repr(v)))
        if bound.integer:
            kinds.append(st.integers(max_value=int(bound.low) - (0 if bound.low_open else 1)).map(str))
    if bound.high is not None:
        kinds.append(st.floats(min_value=bound.high, exclude_min=not bound.high_open, allow_nan=False,
                               allow_infinity=False).map(repr))
        if bound.integer:
            kinds.append(st.integers(min_value=int(bound.high) + (0 if bound.high_open else 1)).map(str))
    if bound.integer:
        kinds.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda v: not v.is_integer()).map(repr))
    kinds.append(st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12))

    def invalid(text: str) -> bool:
        try:
            bound.parse(text)
        except Exception:  # noqa: BLE001 - ArgumentTypeError: exactly what we want
            return True
        return False

    return st.one_of(kinds).filter(invalid)


_CASES = [(command, flag, bound) for command, flags in NUMERIC_FLAGS.items() for flag, bound in flags]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_random_bad_numeric_values_are_refused_in_one_line(capsys, data):
    command, flag, bound = data.draw(st.sampled_from(_CASES), label="flag")
    value = data.draw(_bad_values(bound), label="value")
    argv = [command, *BASE_ARGS.get(command, []), f"{flag}={value}"]
    code, out, err, elapsed = run_cli(argv, capsys)
    assert_refused(code, out, err, elapsed, names=flag, also=bound.describe())


def test_every_numeric_flag_is_covered():
    """A new numeric flag without a declared range would escape the test above."""
    from megatron_rrfp.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for command, sub in commands.items():
        declared = {flag for flag, _ in NUMERIC_FLAGS[command]}
        typed = {next(s for s in a.option_strings if s.startswith("--")) for a in sub._actions
                 if a.option_strings and a.type is not None and a.type is not str}
        assert typed <= declared, (command, typed - declared)
        assert all(getattr(a.type, "__self__", None) is not None for a in sub._actions
                   if a.option_strings and a.type is not None and a.type is not str), command  # Bound.parse


@pytest.mark.parametrize("argv, names", [
    (["simulate", "--pp", "4", "--straggler-stage", "4"], "--straggler-stage"),
    (["simulate", "--pp", "4", "--chunks", "2", "-m", "6", "--buffer-limit", "8"], "--policies 1f1b-strict"),
    (["simulate", "--pp", "4", "--chunks", "2", "-m", "6"], "--buffer-limit"),
    (["simulate", "--pp", "1024", "--chunks", "64", "-m", "100000"],
     "--pipeline-model-parallel-size x --virtual-pipeline-model-parallel-size x --num-microbatches"),
    (["simulate", "--policies", "zigzag"], "unknown hint 'zigzag'"),
    (["simulate", "--policies", "no/such/hint.json"], "does not exist"),
    (["simulate", "--overlap-moe-expert-parallel-comm"], "--num-experts and --expert-model-parallel-size"),
    (["simulate", "--num-experts", "4", "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm",
      "--policies", "default,bfw"], "--policies bfw"),
    (["simulate", "--pp", "2", "-m", "4", "--num-experts", "4", "--expert-model-parallel-size", "2",
      "--overlap-moe-expert-parallel-comm", "--optimal"], "--optimal"),
    (["bench", "--tp", "3"], "--tensor-model-parallel-size"),
    (["bench", "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),  # Megatron-LM's name
    (["bench", "--pp", "4", "--chunks", "2", "-m", "6"], "--schedules"),
    (["bench", "--pp", "64", "--tp", "4", "--dp", "4"],
     "--pipeline-model-parallel-size x --tensor-model-parallel-size x --data-parallel-size"),
    (["simulate", "--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
      "--num-microbatches", "6"], "--buffer-limit"),
    (["bench", "--model", "multimodal", "--seq-length", "8"], "--seq-length"),
    (["bench", "--schedules", "rrfp-bf"], "--schedules"),
    (["demo", "--straggler-stage", "4"], "--straggler-stage"),
    (["bench", "--json", "/no/such/directory/bench.json"], "--json"),
    (["train", "--cpu", "--nproc", "3", "--pipeline-model-parallel-size", "2"], "world size 3"),
    (["train", "--cpu", "--global-batch-size", "7"], "--global-batch-size 7"),
    (["train", "--cpu", "--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr"),
    (["train", "--cpu", "--pipeline-schedule", "rrfp"], "--pipeline-model-parallel-size >= 2"),
])
def test_values_inconsistent_with_the_layout_are_refused_in_one_line(capsys, argv, names):
    code, out, err, elapsed = run_cli(argv, capsys)
    assert_refused(code, out, err, elapsed, names=names)


# -- random malformed hint files -------------------------------------------------------

_TASK_LIKE = st.from_regex(r"\A[0-9]{1,3}[FBWIX][0-9]{1,4}\Z") | st.text(max_size=6)
_JSON_JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                      max_size=3), max_leaves=8)


def _json_hint_payloads() -> st.SearchStrategy[bytes]:
    not_a_stage = _JSON_JUNK.filter(lambda v: not isinstance(v, (str, list)))
    junk_stages = st.lists(not_a_stage, min_size=1, max_size=3).map(lambda s: {"stages": s})
    bad_tasks = st.lists(st.lists(_TASK_LIKE.filter(lambda t: "," not in t), min_size=1, max_size=4),
                         min_size=2, max_size=2).map(lambda s: {"stages": s})
    out_of_range = st.integers(2, 10**6).map(lambda mb: {"stages": [f"0F0,0F1,0B0,0B1,0F{mb}", "0F0,0B0,0F1,0B1"]})
    duplicate = st.just({"stages": ["0F0,0F0,0F1,0B0,0B1", "0F0,0B0,0F1,0B1"]})
    structures = st.one_of(junk_stages, bad_tasks, out_of_range, duplicate, st.just({"stages": [None, None]}),
                           _JSON_JUNK.filter(lambda v: not isinstance(v, (list, dict))), st.just({"stages": []}))
    encoded = structures.map(lambda v: json.dumps(v).encode())
    wrong_encoding = st.sampled_from(["utf-16", "utf-32"]).map(
        lambda enc: json.dumps({"stages": ["0F0,0F1,0B0,0B1", "0F0,0B0,0F1,0B1"]}).encode(enc))
    latin1 = st.just('{"stages": ["0F0,0F1,0B0,0B1", "0F0,0B0,0F1,0B1\u00e9"]}'.encode("latin-1"))
    broken_json = st.binary(max_size=64).filter(_not_json)
    return st.one_of(encoded, wrong_encoding, latin1, broken_json)


def _not_json(data: bytes) -> bool:
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except (ValueError, RecursionError):
        return True
    return not isinstance(value, (list, dict))


def _csv_hint_payloads() -> st.SearchStrategy[bytes]:
    cell = st.from_regex(r"\A[0-9][A-Z_]{1,6}[0-9]\Z") | st.text(st.characters(blacklist_characters=",\n\r\x00",
                                                                                blacklist_categories=("Cs",)),
                                                                  min_size=1, max_size=5)  # a file holds UTF-8
    rows = st.lists(st.lists(cell, min_size=1, max_size=4).map(",".join), min_size=1, max_size=3).map("\n".join)
    malformed = rows.filter(lambda text: _csv_malformed(text)).map(str.encode)
    wrong_encoding = st.just("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n".encode("utf-16"))
    return st.one_of(malformed, wrong_encoding, st.binary(min_size=1, max_size=48).filter(_not_utf8))


def _csv_malformed(text: str) -> bool:
    from megatron_rrfp.policy.hint_specs import load_pipelining_csv
    from megatron_rrfp.policy.hints import HintError
    from megatron_rrfp.policy.plan import Plan

    path = os.path.join(_scratch(), "probe.csv")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    try:
        from megatron_rrfp.policy.arbiter import ArbiterConfig
        from megatron_rrfp.policy.topology import Topology

        Plan.build(ArbiterConfig(hint=load_pipelining_csv(path)), Topology(2), 2)
    except HintError:
        return True
    return False


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return True
    return b"\x00" in data


_SCRATCH: list[str] = []


def _scratch() -> str:
    if not _SCRATCH:
        import tempfile

        _SCRATCH.append(tempfile.mkdtemp(prefix="rrfp-cli-hints-"))
    return _SCRATCH[0]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_random_malformed_hint_files_are_refused_in_one_line_naming_the_file(capsys, data):
    suffix = data.draw(st.sampled_from([".json", ".csv"]), label="format")
    payload = data.draw(_json_hint_payloads() if suffix == ".json" else _csv_hint_payloads(), label="bytes")
    path = os.path.join(_scratch(), f"hint-{time.monotonic_ns()}{suffix}")
    with open(path, "wb") as handle:
        handle.write(payload)
    strict = data.draw(st.booleans(), label="strict")
    if data.draw(st.booleans(), label="via train"):
        argv = ["train", *BASE_ARGS["train"], "--global-batch-size", "4", "--micro-batch-size", "2",
                "--rrfp-hint", path] + (["--rrfp-strict"] if strict else [])
    else:
        argv = ["simulate", "--pp", "2", "-m", "2", "--seeds", "1", "--policies", path + ("-strict" if strict else "")]
    code, out, err, elapsed = run_cli(argv, capsys)
    assert_refused(code, out, err, elapsed, names=os.path.basename(path))


def test_a_bad_value_through_the_installed_command_exits_2_in_one_line():
    """The same path as a shell user: a subprocess, the console entry point's module."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for argv, flag in ((["simulate", "--c50", "nan"], "--c50"), (["bench", "--iterations", "0"], "--iterations")):
        result = subprocess.run([sys.executable, "-m", "megatron_rrfp", *argv], capture_output=True, text=True,
                                timeout=60, env=env)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and flag in lines[0], result.stderr
        assert result.stdout == ""


# -- the same checks for library users -------------------------------------------------

@pytest.mark.parametrize("field", ["c50", "sigma_compute", "backward_ratio", "f0", "sigma_msg"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_variability_refuses_non_finite_and_negative_values(field, value):
    with pytest.raises(ValueError, match=f"{field}.* must be a finite number"):
        Variability(**{field: value})


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_the_dry_run_engine_refuses_a_non_finite_duration_instead_of_spinning(bad):
    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.sim.simulator import policy, simulate
    from megatron_rrfp.sim.variability import sample_realization

    topology = Topology(3)
    realization = sample_realization(Variability(sigma_compute=0.3, c50=0.1), topology, 4, seed=0)
    realization.forward[1][0][2] = bad
    with pytest.raises(ValueError, match=r"duration of task 0F2 on stage 1 is .*must be finite and >= 0"):
        simulate(policy("bf"), topology, 4, realization)
    realization = sample_realization(Variability(sigma_compute=0.3, c50=0.1), topology, 4, seed=0)
    realization.gradient_latency[2][0][1] = bad
    with pytest.raises(ValueError, match=r"message latency of task 0B1 on stage 2"):
        simulate(policy("1f1b-strict"), topology, 4, realization)


def test_study_config_checks_everything_before_simulating():
    with pytest.raises(ValueError, match=r"--seeds must be an integer in \[1, 100000\], got 0"):
        StudyConfig(seeds=0)
    with pytest.raises(ValueError, match="--first-seed"):
        StudyConfig(first_seed=-1)
    with pytest.raises(ValueError, match="--straggler-stage"):
        StudyConfig(pipeline_size=2, variability=Variability(straggler_stage=2))
    with pytest.raises(ValueError, match="--policies"):
        StudyConfig(policies=[])


@pytest.fixture
def no_warning_choice(monkeypatch):
    """A caller that set neither PYTHONWARNINGS nor -W (whatever the suite's own caller set)."""
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    monkeypatch.setattr(sys, "warnoptions", [])


def test_library_calls_leave_warning_filters_alone_and_commands_restore_them(capsys, no_warning_choice):
    """Only the CLI entry points hide megatron-core's known dependency warnings; a
    command run in-process puts the caller's filters, loggers and environment back."""
    import logging
    import warnings

    import megatron.core.pipeline_parallel.schedules  # noqa: F401 - its own import-time filters come first

    from megatron_rrfp import quiet

    before = list(warnings.filters)
    import megatron_rrfp  # noqa: F401
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp  # noqa: F401

    assert warnings.filters == before and quiet.ENV not in os.environ
    assert not [f for f in warnings.filters if getattr(f[3], "pattern", f[3]) == r"megatron\."]  # none of ours
    quiet.from_environment()  # a process no CLI started: nothing
    assert warnings.filters == before
    assert main(["simulate", "--pp", "2", "-m", "4", "--seeds", "1", "--policies", "bf"]) == 0
    assert warnings.filters == before and quiet.ENV not in os.environ
    assert not logging.getLogger("torch.utils.cpp_extension").filters
    with quiet.for_entry_point(announce=False):
        assert os.environ[quiet.ENV] == "1"
        with pytest.warns(UserWarning, match="ours"):  # not a megatron-core note: still shown
            warnings.warn("ours", UserWarning, stacklevel=1)
        with warnings.catch_warnings(record=True) as caught:
            exec(compile("import warnings; warnings.warn('Apex is not installed. Falling back to Torch Norm')",
                         "backends.py", "exec"), {"__name__": "megatron.core.models.backends"})
        assert not caught
        with warnings.catch_warnings(record=True) as caught:  # torch's deprecation of what megatron-core calls
            exec(compile("import warnings; warnings.warn('`torch.distributed.all_gather_into_tensor` is deprecated. "
                         "Please use `torch.distributed.all_gather_single` instead.', FutureWarning)",
                         "c10d_logger.py", "exec"), {"__name__": "torch.distributed.c10d_logger"})
        assert not caught
    assert warnings.filters == before and quiet.ENV not in os.environ


@pytest.mark.parametrize("choice", [("env", "default"), ("env", "ignore"), ("env", "error::DeprecationWarning"),
                                    ("-W", "default"), ("-W", "always::UserWarning")])
def test_a_callers_warning_choice_wins_and_the_suite_does_not_depend_on_it(monkeypatch, choice):
    """The user's PYTHONWARNINGS / -W wins (nothing hidden, no variable for the ranks,
    no one-line note), and the quiet tests above pin the caller's setting themselves, so
    the suite passes under any of these (also run as ``PYTHONWARNINGS=default pytest``)."""
    import warnings

    from megatron_rrfp import quiet

    kind, value = choice
    monkeypatch.delenv(quiet.ENV, raising=False)
    if kind == "env":
        monkeypatch.setenv("PYTHONWARNINGS", value)
        monkeypatch.setattr(sys, "warnoptions", [])
    else:
        monkeypatch.delenv("PYTHONWARNINGS", raising=False)
        monkeypatch.setattr(sys, "warnoptions", [value])
    before = list(warnings.filters)
    with quiet.for_entry_point(announce=True):
        assert quiet.ENV not in os.environ and warnings.filters == before and quiet.note() is None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile("import warnings; warnings.warn('Apex is not installed. Falling back to Torch Norm')",
                         "backends.py", "exec"), {"__name__": "megatron.core.models.backends"})
        assert [str(w.message) for w in caught] == ["Apex is not installed. Falling back to Torch Norm"]
    assert warnings.filters == before and quiet.ENV not in os.environ
