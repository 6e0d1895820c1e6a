"""The package's shape: no import cycles, small modules, the policy torch-free, the public
names and the CLI surface pinned (so a refactor cannot silently break users)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import megatron_rrfp

PACKAGE = pathlib.Path(megatron_rrfp.__file__).parent
MAX_MODULE_LINES = 520


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str) -> set[str]:
    """Every megatron_rrfp module this file imports, at any depth (lazy imports count:
    a cycle hidden in a function is still a cycle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c.startswith("megatron_rrfp"))
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # importing a.b.c runs a/__init__ and a/b/__init__ too; only real modules are nodes
        graph[name] = {t for t in _imports(path, name) if t in files and t != name}
    return graph


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_layers_only_import_downwards():
    """policy <- sim <- runtime <- mcore <- megatron_lm: the policy never imports its
    simulator, the runtime never imports benchmarks or Megatron-LM."""
    forbidden = {
        "megatron_rrfp.policy": ("sim", "runtime", "mcore", "megatron_lm", "bench", "train", "goodput", "trace",
                                 "verify"),
        "megatron_rrfp.sim": ("runtime", "mcore", "megatron_lm", "bench", "train", "goodput", "verify"),
        "megatron_rrfp.runtime": ("sim", "mcore", "megatron_lm", "bench", "train", "goodput", "verify"),
        "megatron_rrfp.mcore": ("sim", "megatron_lm", "bench", "train", "goodput", "verify"),
        "megatron_rrfp.goodput": ("sim", "mcore", "megatron_lm", "bench", "train", "verify"),
        "megatron_rrfp.bench": ("verify",),  # benchmarks measure; verification tools check
    }
    for module, targets in _graph().items():
        for layer, banned in forbidden.items():
            if module == layer or module.startswith(layer + "."):
                bad = [t for t in targets if any(t.startswith(f"megatron_rrfp.{b}") for b in banned)]
                assert not bad, f"{module} imports {bad}"


def test_verification_tools_live_in_verify_and_bench_keeps_benchmarks():
    verify = {p.name for p in (PACKAGE / "verify").glob("*.py")}
    assert {"selfcheck.py", "selfcheck_gpt.py", "selfcheck_loopback.py", "queue_device.py"} <= verify, verify
    bench = {p.name for p in (PACKAGE / "bench").glob("*.py")}
    assert not {n for n in bench if n.startswith("selfcheck") or n == "queue_device.py"}
    scripts = PACKAGE.parent / "scripts"
    assert not list(scripts.glob("issue*.py")), "scripts are named for what they do, not for an issue number"
    assert "megatron_rrfp.verify.selfcheck" in (scripts / "gpu_selfcheck.py").read_text(encoding="utf-8")


def test_test_code_and_research_drivers_live_outside_the_package():
    """The whole-job transport emulation (with the pre-rounds protocol and the ablations that
    deadlock), the default policy's grid and the benchmark table live in tests/helpers and
    scripts/; the package has no runnable module but its commands."""
    tests = pathlib.Path(__file__).parent
    assert (tests / "helpers" / "emulated_pipeline.py").exists() and (tests / "helpers" / "default_grid.py").exists()
    assert (PACKAGE.parent / "scripts" / "bench_suite.py").exists()
    for gone in ("verify/emulated_pipeline.py", "sim/grid.py", "bench/suite.py"):
        assert not (PACKAGE / gone).exists(), gone
    runnable = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                if '__name__ == "__main__"' in p.read_text(encoding="utf-8")}
    assert runnable <= {"cli.py", "launch.py", "megatron_lm/launch.py", "train/driver.py", "train/data.py",
                        "bench/run.py"}, runnable


def test_modules_stay_small():
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_public_names():
    assert set(megatron_rrfp.__all__) >= {
        "forward_backward_rrfp", "get_forward_backward_func", "install", "uninstall", "configure", "RRFPConfig",
        "last_iteration_report", "shutdown", "Arbiter", "ArbiterConfig", "Task", "Topology", "make_hint",
        "__version__"}
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp, get_forward_backward_func
    from megatron_rrfp.megatron_lm.install import install

    assert megatron_rrfp.forward_backward_rrfp is forward_backward_rrfp
    assert megatron_rrfp.get_forward_backward_func is get_forward_backward_func
    assert megatron_rrfp.install is install


def test_cli_surface_and_version():
    from megatron_rrfp.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == {"simulate", "bench", "demo", "compare", "goodput", "train"}
    out = subprocess.run([sys.executable, "-m", "megatron_rrfp", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"megatron-rrfp {megatron_rrfp.__version__}"
    launch = subprocess.run([sys.executable, "-m", "megatron_rrfp.launch", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert launch.returncode == 0 and "entry script" in launch.stdout


def test_runtime_ships_no_test_seams():
    """No sleeps, fault switches or test-only environment variables in the shipped runtime."""
    for folder in ("runtime", "mcore", "policy"):
        for path in (PACKAGE / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for seam in ("time.sleep(", "task_delay", "message_delay", "RRFP_TEST", "os.environ"):
                assert seam not in text, f"{path.relative_to(PACKAGE)} contains {seam!r}"
