"""megatron_rrfp.megatron_lm (install, launch) and patches/apply.sh, against what is installed.

    python -m pytest tests/e2e/test_integration.py -q        # ~1 min on 2 cores

CI cannot fetch Megatron-LM, so nothing here needs a checkout. The add_megatron_arguments
hook runs against the real ``megatron.training.arguments`` when it is importable, and
otherwise against a minimal stand-in with the same shape (a module-level
``add_megatron_arguments`` that its ``parse_args`` looks up at call time); test ids say
which: ``[megatron.training]`` or ``[stand-in]``. Schedule routing always uses the real
megatron-core. The end-to-end run of Megatron-LM's pretrain_gpt.py on CPU is a local
check with a fetched checkout (see README).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from megatron_rrfp.launch.function import launch
from megatron_rrfp.megatron_lm import install as integration

REAL_TRAINING = importlib.util.find_spec("megatron.training") is not None
ARGS_PATH = "megatron.training" if REAL_TRAINING else "stand-in"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The CLI surface the hook adds to Megatron-LM's parser (frozen: changing it is a decision).
RRFP_FLAGS = {"--pipeline-schedule", "--rrfp-hint", "--rrfp-buffer-limit", "--rrfp-strict", "--rrfp-timeout",
              "--rrfp-dp-overlap", "--rrfp-trace-dir", "--rrfp-goodput-ledger"}

# The shape of Megatron-LM's megatron/training/arguments.py that the hook relies on
# (written for this test, not copied): parse_args() calls the *module-level*
# add_megatron_arguments, then the entry script's extra_args_provider.
_STAND_IN_ARGUMENTS = textwrap.dedent('''
    import argparse

    def add_megatron_arguments(parser):
        parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
        parser.add_argument("--micro-batch-size", type=int, default=1)
        parser.add_argument("--expert-model-parallel-size", type=int, default=1)
        parser.add_argument("--moe-shared-expert-overlap", action="store_true")
        parser.add_argument("--overlap-moe-expert-parallel-comm", action="store_true")
        return parser

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(description="stand-in", allow_abbrev=False)
        parser = add_megatron_arguments(parser)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        if ignore_unknown_args:
            return parser.parse_known_args()[0]
        return parser.parse_args()
''')


def _stand_in_training(monkeypatch) -> types.ModuleType:
    """Register megatron.training(.arguments) stand-ins; only used when the real one is absent."""
    package = types.ModuleType("megatron.training")
    package.__path__ = []
    arguments = types.ModuleType("megatron.training.arguments")
    exec(compile(_STAND_IN_ARGUMENTS, "<stand-in megatron.training.arguments>", "exec"), arguments.__dict__)
    package.arguments = arguments
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)
    return arguments


@pytest.fixture(autouse=True)
def _clean_install():
    integration.uninstall()
    yield
    integration.uninstall()


@pytest.fixture(params=[ARGS_PATH])
def arguments(request, monkeypatch) -> types.ModuleType:
    """megatron.training.arguments: the real module or the stand-in (see the test id)."""
    if REAL_TRAINING:
        import megatron.training.arguments as real

        return real
    return _stand_in_training(monkeypatch)


def _parse(arguments, monkeypatch, argv: list[str], extra_args_provider=None) -> argparse.Namespace:
    """Megatron-LM's own parse_args (it reads sys.argv), after install()."""
    integration.install()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return arguments.parse_args(extra_args_provider, ignore_unknown_args=False)


def _megatron_lookup():
    from megatron.core.pipeline_parallel import schedules

    return schedules.get_forward_backward_func


# -- flags through Megatron-LM's parser ------------------------------------------------


def test_install_adds_the_flags_and_defaults_change_nothing(arguments, monkeypatch):
    original_lookup = _megatron_lookup()
    args = _parse(arguments, monkeypatch, [])
    assert (args.pipeline_schedule, args.rrfp_hint, args.rrfp_buffer_limit, args.rrfp_strict, args.rrfp_timeout,
            args.rrfp_trace_dir, args.rrfp_goodput_ledger) == ("1f1b", "default", "1x", False, 600.0, None, None)
    import megatron.core.pipeline_parallel as pipeline_parallel

    assert not integration.routed()
    assert pipeline_parallel.get_forward_backward_func is original_lookup
    assert _megatron_lookup() is original_lookup


def test_cli_surface_is_frozen_and_hooked_once(arguments):
    integration.install()
    integration.install()  # idempotent: still one wrapper around Megatron's function
    hooked = arguments.add_megatron_arguments
    assert hooked.__wrapped__ is not hooked and not hasattr(hooked.__wrapped__, "__wrapped__")
    parser = hooked(argparse.ArgumentParser(allow_abbrev=False))
    added = {s for s in parser._option_string_actions if "rrfp" in s or s == "--pipeline-schedule"}
    assert added == RRFP_FLAGS


def test_entry_script_keeps_its_extra_args_provider_slot(arguments, monkeypatch):
    def extra_args_provider(parser):  # what pretrain_gpt.py / pretrain_vlm.py pass
        parser.add_argument("--freeze-LM", action="store_true")
        return parser

    args = _parse(arguments, monkeypatch, ["--freeze-LM", "--pipeline-schedule", "rrfp", "--rrfp-buffer-limit", "16"],
                  extra_args_provider)
    assert args.freeze_LM and args.pipeline_schedule == "rrfp" and args.rrfp_buffer_limit == 16


def test_expert_parallelism_is_accepted_with_rrfp(arguments, monkeypatch):
    args = _parse(arguments, monkeypatch, ["--pipeline-schedule", "rrfp", "--pipeline-model-parallel-size", "2",
                                           "--expert-model-parallel-size", "2"])
    assert args.pipeline_schedule == "rrfp" and args.expert_model_parallel_size == 2


@pytest.mark.parametrize("argv, flag", [
    (["--pipeline-schedule", "gpipe"], "--pipeline-schedule"),
    (["--pipeline-schedule", "rrfp", "--rrfp-buffer-limit", "0"], "--rrfp-buffer-limit"),
    (["--pipeline-schedule", "rrfp", "--rrfp-buffer-limit", "many"], "--rrfp-buffer-limit"),
    (["--pipeline-schedule", "rrfp", "--rrfp-buffer-limit", "0x"], "--rrfp-buffer-limit"),
    (["--pipeline-schedule", "rrfp", "--rrfp-timeout", "0"], "--rrfp-timeout"),
    (["--pipeline-schedule", "rrfp", "--rrfp-timeout", "soon"], "--rrfp-timeout"),
    (["--pipeline-schedule", "rrfp", "--rrfp-timeout", "nan"], "--rrfp-timeout"),
    (["--pipeline-schedule", "rrfp", "--rrfp-timeout", "inf"], "--rrfp-timeout"),
    (["--pipeline-schedule", "rrfp", "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
      "--moe-shared-expert-overlap"], "--moe-shared-expert-overlap"),
    # accepted with virtual stages; without them megatron-core's TransformerConfig (built by Megatron-LM) refuses it
    (["--pipeline-schedule", "rrfp", "--pipeline-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"],
     "needs --virtual-pipeline-model-parallel-size"),
    (["--pipeline-schedule", "rrfp", "--pipeline-model-parallel-size", "2", "--rrfp-hint", "{hint3}"],
     "lists 3 stages but the pipeline has 2"),
    (["--pipeline-schedule", "rrfp", "--rrfp-hint", "no-such-hint"], "--rrfp-hint"),
    (["--pipeline-schedule", "rrfp", "--rrfp-trace-dir", "{file}"], "--rrfp-trace-dir"),
    (["--pipeline-schedule", "rrfp", "--rrfp-goodput-ledger", "{file}/ledger.sqlite"], "--rrfp-goodput-ledger"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bad_value_exits_with_an_error_naming_the_flag(arguments, monkeypatch, capsys, tmp_path, argv, flag):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    hint3 = tmp_path / "three-stages.json"
    hint3.write_text(json.dumps({"stages": ["0F0,0B0"] * 3}))
    argv = [a.format(file=a_file, hint3=hint3) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        _parse(arguments, monkeypatch, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err, err
    assert not integration.routed()


@pytest.mark.parametrize("flag", [["--rrfp-strict"], ["--rrfp-buffer-limit", "8"], ["--rrfp-hint", "gpipe"],
                                  ["--rrfp-timeout", "30"]], ids=lambda f: f[0])
def test_rrfp_flags_without_the_rrfp_schedule_are_an_error(arguments, monkeypatch, capsys, flag):
    with pytest.raises(SystemExit) as exit_info:
        _parse(arguments, monkeypatch, flag)
    assert exit_info.value.code == 2
    assert "--pipeline-schedule rrfp" in capsys.readouterr().err


def test_cli_rrfp_routes_with_the_flags_options_and_1f1b_restores(arguments, monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    from megatron_rrfp.mcore.config import configure
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp

    original = _megatron_lookup()
    _parse(arguments, monkeypatch, ["--pipeline-schedule", "rrfp", "--rrfp-buffer-limit", "16", "--rrfp-strict",
                                    "--rrfp-timeout", "30"])
    assert integration.routed()
    config = configure()
    policy = config.arbiter
    assert (policy.parsed_hint.name, policy.buffer_limit, policy.strict, config.timeout_s) == \
        ("default", 16, True, 30.0)
    assert schedules.get_forward_backward_func(pp_size=2, vp_size=None) is forward_backward_rrfp
    assert schedules.get_forward_backward_func(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
    _parse(arguments, monkeypatch, ["--pipeline-schedule", "1f1b"])
    assert not integration.routed() and _megatron_lookup() is original


# -- routing against the real megatron-core ----------------------------------------------


def _lookups_under_rrfp() -> dict:
    """Rank function: what Megatron's lookups return before, under and after rrfp."""
    import megatron.core.pipeline_parallel as pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    from megatron_rrfp.mcore.schedule import forward_backward_rrfp
    from megatron_rrfp.megatron_lm import install as integ

    original = schedules.get_forward_backward_func
    megatron_choice = original()
    integ.install(schedule="rrfp", buffer_limit=8)
    under = {"package": pipeline_parallel.get_forward_backward_func(),
             "schedules": schedules.get_forward_backward_func()}
    result = {name: ("rrfp" if fn is forward_backward_rrfp else "megatron" if fn is megatron_choice else repr(fn))
              for name, fn in under.items()}
    integ.install(schedule="1f1b")
    result["restored_by_1f1b"] = (pipeline_parallel.get_forward_backward_func is original
                                  and schedules.get_forward_backward_func is original)
    integ.install(schedule="rrfp")
    integ.uninstall()
    result["restored_by_uninstall"] = (pipeline_parallel.get_forward_backward_func is original
                                       and schedules.get_forward_backward_func is original)
    result["megatron_choice"] = megatron_choice.__name__
    return result


@pytest.mark.timeout(180)
def test_routing_pp2_returns_rrfp_and_1f1b_or_uninstall_restore():
    for result in launch(_lookups_under_rrfp, world_size=2, pp=2, timeout=150):
        assert result == {"package": "rrfp", "schedules": "rrfp", "restored_by_1f1b": True,
                          "restored_by_uninstall": True,
                          "megatron_choice": "forward_backward_pipelining_without_interleaving"}


@pytest.mark.timeout(180)
def test_routing_pp1_keeps_megatrons_function():
    for result in launch(_lookups_under_rrfp, world_size=2, pp=1, timeout=150):
        assert result == {"package": "megatron", "schedules": "megatron", "restored_by_1f1b": True,
                          "restored_by_uninstall": True, "megatron_choice": "forward_backward_no_pipelining"}


def test_modules_that_imported_the_lookup_by_name_are_rerouted(monkeypatch):
    """Megatron-LM's training.py does `from megatron.core.pipeline_parallel import
    get_forward_backward_func` at import time; such copies must follow the routing."""
    original = _megatron_lookup()
    binder = types.ModuleType("rrfp_test_binds_lookup_by_name")
    binder.get_forward_backward_func = original
    monkeypatch.setitem(sys.modules, binder.__name__, binder)
    integration.install(schedule="rrfp")
    assert binder.get_forward_backward_func is integration.get_forward_backward_func
    late = types.ModuleType("rrfp_test_imported_while_routed")  # bound the replacement
    import megatron.core.pipeline_parallel as pipeline_parallel

    late.get_forward_backward_func = pipeline_parallel.get_forward_backward_func
    monkeypatch.setitem(sys.modules, late.__name__, late)
    integration.install(schedule="1f1b")
    assert binder.get_forward_backward_func is original and late.get_forward_backward_func is original
    assert integration.get_forward_backward_func.__module__ == integration.__name__  # ours stays ours


def test_schedule_pg_collection_keyword_of_0_19_decides_the_pipeline_size():
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp

    class _Group:
        def size(self):
            return 4

    collection = types.SimpleNamespace(pp=_Group())
    integration.install(schedule="rrfp")
    assert integration.get_forward_backward_func(schedule_pg_collection=collection) is forward_backward_rrfp


def test_programmatic_install_validates_and_announces_once(capsys):
    from megatron_rrfp.mcore.config import configure

    with pytest.raises(ValueError, match="choose one of 1f1b, rrfp"):
        integration.install(schedule="gpipe")
    with pytest.raises(ValueError, match="need schedule='rrfp'"):
        integration.install(schedule="1f1b", buffer_limit=4)
    with pytest.raises(ValueError, match="buffer_limit"):
        integration.install(schedule="rrfp", buffer_limit=0)
    assert not integration.routed()
    integration.install(schedule="rrfp", hint="bf", buffer_limit=16)
    assert configure().arbiter.buffer_limit == 16
    capsys.readouterr()
    for _ in range(3):
        integration.get_forward_backward_func(pp_size=2, vp_size=None)
    assert capsys.readouterr().out == "megatron-rrfp: pipeline schedule rrfp (hint=bf, buffer_limit=16)\n"
    integration.uninstall()
    assert configure().arbiter.buffer_limit == "1x"  # defaults are back


@pytest.mark.skipif(REAL_TRAINING, reason="megatron.training is importable: the [megatron.training] tests cover it")
def test_without_megatron_training_install_only_routes(monkeypatch):
    """megatron-core-only installs (the 0.16.1 wheel): install() hooks no parser, routing works."""
    integration.install()
    assert integration._state.arguments_module is None and not integration.routed()
    integration.install(schedule="rrfp")
    assert integration.routed()


# -- megatron.training itself (skipped without Megatron-LM on the path) -------------------


def test_real_megatron_training_binds_the_routed_lookup():
    training = pytest.importorskip("megatron.training.training")
    integration.install(schedule="rrfp")
    assert training.get_forward_backward_func is integration.get_forward_backward_func
    integration.install(schedule="1f1b")
    assert training.get_forward_backward_func is _megatron_lookup()


# -- the launcher ------------------------------------------------------------------------

_PROBE = textwrap.dedent('''
    import json, os, sys
    import torch
    report = {"name": __name__, "argv": sys.argv, "path0": sys.path[0]}
    if os.environ.get("PROBE_CUDA"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); end.record(); torch.cuda.synchronize()
        state = torch.cuda.get_rng_state(); torch.cuda.manual_seed(3); a = torch.rand(2)
        torch.cuda.set_rng_state(state); torch.cuda.manual_seed(3); b = torch.rand(2)
        torch.cuda.set_device(0)
        report.update(device_count=torch.cuda.device_count(), zeros=str(torch.zeros(2, device="cuda").device),
                      tensor=str(torch.tensor([1], device=torch.cuda.current_device()).device),
                      dot_cuda=str(torch.ones(1).cuda().device), elapsed_ms=start.elapsed_time(end),
                      rng_repeats=bool(torch.equal(a, b)),
                      # what Megatron-LM's validate_args asks at TP > 1 (get_device_arch_version)
                      arch=torch.cuda.get_device_properties(torch.device("cuda:0")).major,
                      max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    print("PROBE " + json.dumps(report))
''')


def _run_launcher(tmp_path, *launcher_args, env_extra=None) -> dict:
    script = tmp_path / "entry.py"
    script.write_text(_PROBE)
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    args = [a if a != "SCRIPT" else str(script) for a in launcher_args]
    proc = subprocess.run([sys.executable, "-m", "megatron_rrfp.launch", *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(text for text in proc.stdout.splitlines() if text.startswith("PROBE "))
    return {"script": str(script), **json.loads(line[len("PROBE "):])}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["--cpu", "RRFP_CPU=1"])
def test_launcher_runs_the_script_as_main_and_cpu_mode_redirects_cuda_calls(tmp_path, how):
    env = {"PROBE_CUDA": "1", **({"RRFP_CPU": "1"} if how == "RRFP_CPU=1" else {})}
    script_args = ["--pipeline-schedule", "rrfp", "--cpu", "x"] if how == "--cpu" else []
    out = _run_launcher(tmp_path, *(["--cpu"] if how == "--cpu" else []), "SCRIPT", *script_args, env_extra=env)
    assert out["name"] == "__main__"
    assert out["argv"] == [out["script"], *script_args]  # after SCRIPT: the script's own, a --cpu among them
    assert out["path0"] == os.path.dirname(out["script"])
    assert out["device_count"] == 1
    assert out["zeros"] == out["tensor"] == out["dot_cuda"] == "cpu"
    assert out["elapsed_ms"] >= 0 and out["rng_repeats"]
    assert out["arch"] == 0 and out["max_connections"] == "1"


def test_launcher_rejects_a_missing_script(tmp_path, capsys):
    from megatron_rrfp.launch.megatron_lm import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "no_such_script.py")])
    assert exit_info.value.code == 2 and "not found" in capsys.readouterr().err


# -- patches/ ----------------------------------------------------------------------------


def _fake_checkout(root, minor: int, patch: int):
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = {patch}\n")
    (root / "pretrain_gpt.py").write_text("print('a file that is not Megatron-LM's')\n")
    (root / "pretrain_vlm.py").write_text("")
    return root


@pytest.mark.parametrize("minor, patch, message", [
    (14, 0, "is not supported (0.15.x - 0.19.x)"),
    (20, 0, "is not supported (0.15.x - 0.19.x)"),
    (16, 1, "does not apply"),  # supported release, but the scripts differ: nothing is changed
    (19, 0, "has no pretrain_hybrid.py"),  # 0.18+ checkouts have HybridModel's entry script too
])
def test_apply_sh_refuses_with_a_clear_message(tmp_path, minor, patch, message):
    checkout = _fake_checkout(tmp_path / "Megatron-LM", minor, patch)
    before = (checkout / "pretrain_gpt.py").read_text()
    proc = subprocess.run(["bash", os.path.join(REPO, "patches", "apply.sh"), str(checkout)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert (checkout / "pretrain_gpt.py").read_text() == before


PATCHES = ("megatron-lm-core_v0.15.0.patch", "megatron-lm-core_v0.16.1.patch", "megatron-lm-core_v0.19.0.patch")
INSTALL_LINE = "import megatron_rrfp; megatron_rrfp.install()"


def _pre_image_checkout(root, patch_name: str, release: str):
    """A checkout whose two scripts are exactly what the patch expects around its line
    (rebuilt from the patch's own context, padded to its line numbers)."""
    major, minor, micro = release.split(".")
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(
        f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {micro}\nPRE_RELEASE = 'rc0'\n")
    with open(os.path.join(REPO, "patches", patch_name)) as f:
        text = f.read()
    for section in text.split("diff --git ")[1:]:
        name = section.split()[0][2:]
        start = int(section.split("@@ -")[1].split(",")[0])
        body = section.split("@@\n", 1)[1].splitlines()
        old = [line[1:] for line in body if line[:1] in (" ", "-")]
        (root / name).write_text("".join(f"# line {i}\n" for i in range(1, start)) + "\n".join(old) + "\nrest()\n")
    return root


@pytest.mark.parametrize("patch_name, release", [
    ("megatron-lm-core_v0.15.0.patch", "0.15.4"), ("megatron-lm-core_v0.16.1.patch", "0.17.0"),
    ("megatron-lm-core_v0.19.0.patch", "0.19.0"), ("megatron-lm-core_v0.19.0.patch", "0.18.3")])
def test_apply_sh_adds_the_line_even_inside_another_repository_and_only_once(tmp_path, patch_name, release):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)  # a vendored copy inside a project
    checkout = _pre_image_checkout(tmp_path / "third_party" / "Megatron-LM", patch_name, release)
    script = ["bash", os.path.join(REPO, "patches", "apply.sh"), str(checkout)]
    proc = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and f"applied {patch_name}" in proc.stdout, proc.stdout + proc.stderr
    names = _patched_files(patch_name)
    assert ("pretrain_hybrid.py" in names) == (release >= "0.18"), names  # HybridModel's entry script, 0.18+
    for name in names:
        assert (checkout / name).read_text().splitlines().count(INSTALL_LINE) == 1, name
    again = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already has the line" in again.stdout, again.stdout + again.stderr
    (checkout / "pretrain_vlm.py").write_text((checkout / "pretrain_vlm.py").read_text().replace(INSTALL_LINE, ""))
    partial = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert partial.returncode == 1 and "only some of" in partial.stderr, partial.stderr


def _patched_files(patch_name: str) -> list[str]:
    with open(os.path.join(REPO, "patches", patch_name)) as f:
        return [section.split()[0][2:] for section in f.read().split("diff --git ")[1:]]


def test_patches_add_only_the_install_line():
    for name in PATCHES:
        with open(os.path.join(REPO, "patches", name)) as f:
            lines = f.read().splitlines()
        added = [line for line in lines if line.startswith("+") and not line.startswith("+++")]
        removed = [line for line in lines if line.startswith("-") and not line.startswith("---")]
        files = _patched_files(name)
        assert added == ["+import megatron_rrfp; megatron_rrfp.install()"] * len(files) and removed == [], name
        assert files[0] == "pretrain_gpt.py" and "pretrain_vlm.py" in files, (name, files)
        assert not any("copyright" in line.lower() for line in lines), name
