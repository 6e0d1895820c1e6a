"""The package's shape: no import cycles, small modules, the policy torch-free, the public
names and the CLI surface pinned (so a refactor cannot silently break users)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Optional

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


def test_every_import_of_the_package_resolves():
    """An import of a moved module fails here, not in a rank (a lazy import runs only when its function does)."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    folders = {".".join(p.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("*") if p.is_dir()}
    missing = []
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("megatron_rrfp")):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if target not in modules | folders:
                    missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {target}")
    assert not missing, missing


def test_layers_only_import_downwards():
    """policy <- sim <- runtime <- split / mcore <- megatron_lm: the policy never imports its
    simulator, the runtime never imports benchmarks or Megatron-LM, the B/W split (split/)
    only megatron-core's adapter (mcore.compat) of the mcore layer; nothing in the package imports
    the GPU self-check (selfcheck/), which imports no simulator, ledger or Megatron-LM layer. One
    exemption: mcore.epoch_tuning runs the simulator once per job to choose the rule's variant."""
    forbidden = {
        "megatron_rrfp.policy": ("sim", "runtime", "mcore", "split", "megatron_lm", "bench", "train", "goodput",
                                 "trace", "selfcheck"),
        "megatron_rrfp.sim": ("runtime", "mcore", "split", "megatron_lm", "bench", "train", "goodput", "selfcheck"),
        "megatron_rrfp.runtime": ("sim", "mcore", "split", "megatron_lm", "bench", "train", "goodput", "selfcheck"),
        "megatron_rrfp.split": ("sim", "runtime", "megatron_lm", "bench", "train", "goodput", "selfcheck"),
        "megatron_rrfp.mcore": ("sim", "megatron_lm", "bench", "train", "goodput", "selfcheck"),
        "megatron_rrfp.goodput": ("sim", "mcore", "split", "megatron_lm", "bench", "train", "selfcheck"),
        "megatron_rrfp.bench": ("selfcheck",),  # benchmarks measure; verification tools check
        "megatron_rrfp.selfcheck": ("sim", "megatron_lm", "goodput", "trace"),  # checks megatron-core's path
        # starting ranks knows no schedule: it runs what it is given (a function, a module, a Megatron-LM script)
        "megatron_rrfp.launch": ("policy", "sim", "runtime", "mcore", "split", "bench", "train", "goodput", "trace",
                                 "selfcheck"),
        # what ranks share once they run (one-write lines, the max over ranks), and where a rank finds its place
        # in the job: below everything that starts or runs ranks
        "megatron_rrfp.ranks": ("policy", "sim", "runtime", "mcore", "split", "megatron_lm", "bench", "train",
                                "goodput", "trace", "selfcheck", "launch", "cpu"),
        "megatron_rrfp.launch.env": ("policy", "sim", "runtime", "mcore", "split", "megatron_lm", "bench", "train",
                                     "goodput", "trace", "selfcheck", "launch", "cpu", "ranks"),
    }
    # the one place a run consults the simulator: once per job, to choose the DP epoch rule's variant
    allowed = {"megatron_rrfp.mcore.epoch_tuning": {"megatron_rrfp.sim.dp_epochs", "megatron_rrfp.sim.dp_comm",
                                                    "megatron_rrfp.sim.variability"}}
    for module, targets in _graph().items():
        targets = set(targets) - allowed.get(module, set())
        for layer, banned in forbidden.items():
            if module == layer or module.startswith(layer + "."):
                bad = [t for t in targets if any(t.startswith(f"megatron_rrfp.{b}") for b in banned)]
                assert not bad, f"{module} imports {bad}"
        if not module.startswith("megatron_rrfp.selfcheck"):  # not used by training: scripts/ run it
            assert not [t for t in targets if t.startswith("megatron_rrfp.selfcheck")], module
        if module.startswith("megatron_rrfp.split"):
            of_mcore = {t for t in targets if t.startswith("megatron_rrfp.mcore")}
            assert of_mcore <= {"megatron_rrfp.mcore.compat", "megatron_rrfp.mcore"}, f"{module} imports {of_mcore}"


def test_the_cpu_shim_sits_below_the_schedule():
    """The CUDA stand-ins (cpu/) import, of this package, only megatron-core's adapter and
    Megatron-LM's layout; the policy, the runtime, the B/W split and the schedule never import them."""
    for module, targets in _graph().items():
        if module.startswith("megatron_rrfp.cpu"):
            outside = {t for t in targets if not t.startswith("megatron_rrfp.cpu")}
            assert outside <= {"megatron_rrfp.mcore.compat", "megatron_rrfp.megatron_lm.layout"}, (module, outside)
        if module.startswith(("megatron_rrfp.policy", "megatron_rrfp.runtime", "megatron_rrfp.split",
                              "megatron_rrfp.mcore")):
            assert not [t for t in targets if t.startswith("megatron_rrfp.cpu")], module

def test_the_selfcheck_lives_in_selfcheck_and_bench_keeps_benchmarks():
    """The GPU self-check is one folder: its runner and one module of steps per concern."""
    selfcheck = {p.name for p in (PACKAGE / "selfcheck").glob("*.py")}
    assert {"cli.py", "runner.py", "result.py", "device.py", "loopback.py", "stress.py", "equivalence.py", "te.py",
            "host_channel.py"} <= selfcheck, selfcheck
    assert not (PACKAGE / "verify").exists()
    assert not [p for p in PACKAGE.rglob("selfcheck*.py")], "the self-check's modules live in selfcheck/"
    bench = {p.name for p in (PACKAGE / "bench").glob("*.py")}
    assert not {n for n in bench if n.startswith("selfcheck") or n == "host_channel.py"}
    scripts = PACKAGE.parent / "scripts"
    assert not list(scripts.glob("issue*.py")), "scripts are named for what they do, not for an issue number"
    assert "megatron_rrfp.selfcheck.cli" in (scripts / "gpu_selfcheck.py").read_text(encoding="utf-8")


def test_test_code_and_research_drivers_live_outside_the_package():
    """The whole-job transport emulation (with the pre-rounds protocol and the ablations that
    deadlock), the default policy's grid and the benchmark table live in tests/helpers and
    scripts/; the package has no runnable module but its commands."""
    tests = pathlib.Path(__file__).parents[1]
    assert all((tests / "helpers" / name).exists() for name in ("emulated_pipeline.py", "queue_device.py",
                                                                "default_grid.py"))
    assert (PACKAGE.parent / "scripts" / "bench_suite.py").exists()
    for gone in ("verify/emulated_pipeline.py", "verify/queue_device.py", "sim/grid.py", "bench/suite.py"):
        assert not (PACKAGE / gone).exists(), gone
    runnable = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                if '__name__ == "__main__"' in p.read_text(encoding="utf-8")}
    assert runnable <= {"cli.py", "train/driver.py", "train/data.py", "bench/rank.py"}, runnable


# What starts processes or ranks; only launch/ may (launch/env.py asks scontrol for SLURM's host names,
# the self-check probes the GPU in a child, both with subprocess.run).
STARTS_RANKS = ("multiprocessing", "torch.distributed.run", "torch.distributed.elastic", "os.fork", "subprocess.Popen")


def _starts_ranks(tree: ast.AST) -> set[str]:
    """Of ``STARTS_RANKS``, what a module imports, calls or names as a module to run (code only, not prose)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            used.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
        elif isinstance(node, ast.Attribute):
            used.add(ast.unparse(node))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            used.add(node.value)
    return {s for s in STARTS_RANKS if any(u == s or u.startswith(s + ".") for u in used)}


def test_ranks_are_started_only_in_launch_and_each_name_says_what_it_is():
    """How ranks get started is one folder (``launch/``, one module per way, listed in its
    ``__init__``); ``python -m megatron_rrfp.launch`` is that folder. No two modules of the
    package are named ``launch`` or ``hooks``."""
    starters = {str(p.relative_to(PACKAGE)): found for p in PACKAGE.rglob("*.py")
                if (found := _starts_ranks(ast.parse(p.read_text(encoding="utf-8"))))}
    assert {"launch/function.py", "launch/forked.py", "launch/torchrun.py"} <= set(starters), starters  # it sees them
    outside = {where: found for where, found in starters.items() if not where.startswith("launch/")}
    assert not outside, outside
    launch = {p.name for p in (PACKAGE / "launch").glob("*.py")}
    assert {"__init__.py", "__main__.py", "function.py", "forked.py", "torchrun.py", "megatron_lm.py"} <= launch
    assert not (PACKAGE / "dist").exists() and not (PACKAGE / "launch.py").exists()  # rendezvous is launch/env.py
    doc = (PACKAGE / "launch" / "__init__.py").read_text(encoding="utf-8")
    assert all(f"``{name}``" in doc or f"{name.removesuffix('.py')}." in doc
               for name in launch - {"__init__.py", "rank_filters.py"}), doc
    names = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if p.stem in ("launch", "hooks", "hookpoints")]
    assert not names, names


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


# Where the package may sleep or read the environment, and why; nowhere else (the runtime never does).
MAY_SLEEP = {
    "launch": "supervising rank processes", "goodput": "the ledger writer's retry on a locked database",
    "selfcheck": "the self-check's polling and its drifting stand-in tasks", "bench": "emulated device time",
}
MAY_READ_ENVIRONMENT = {
    "launch": "the ranks' environment and torch.distributed's rendezvous variables",
    "megatron_lm": "Megatron-LM's launch and CUDA settings",
    "train": "the launcher's rank variables", "selfcheck": "the self-check's launch",
    "bench": "temporary paths",
    "cpu": "CUDA_DEVICE_MAX_CONNECTIONS, which Megatron-LM's argument checks require",
    "quiet.py": "RRFP_QUIET_DEPENDENCIES",
}
TEST_ONLY_IMPORTS = ("pytest", "unittest", "helpers", "tests", "conftest")


def _place(path: pathlib.Path) -> str:
    """A module's top folder under the package (``runtime``), or its file name at the top."""
    return path.relative_to(PACKAGE).parts[0]


def _bound_to_package(tree: ast.AST, name: str, path: pathlib.Path) -> dict[str, str]:
    """Names a module binds, anywhere in it, to a megatron_rrfp module or to a name imported from one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] == "megatron_rrfp":
                bound.update({alias.asname or alias.name: f"{target}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Import):
            bound.update({alias.asname or alias.name.split(".")[0]: alias.name for alias in node.names
                          if alias.name.split(".")[0] == "megatron_rrfp"})
    return bound


def _assigned_attributes(tree: ast.AST) -> Iterator[tuple[int, ast.Attribute]]:
    """Every ``x.attr = ...`` (plain, augmented, annotated, in a tuple) and ``setattr(x, ...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args):
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        else:
            continue
        for target in targets:
            for one in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                if isinstance(one, ast.Attribute):
                    yield node.lineno, one


def _root_name(node: ast.AST) -> Optional[str]:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_package_ships_no_test_seams():
    """Anywhere in the package: no fault switch or test-only variable, no import of test code,
    and no module replacing a name of another of this package's modules or classes at run time
    (what wraps the runtime from outside uses its extension points: ``RRFPConfig.around_task`` /
    ``deliver_message``, ``dp_overlap='lockstep'``). Sleeps and environment reads only where
    ``MAY_SLEEP`` / ``MAY_READ_ENVIRONMENT`` say why."""
    patched, found = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        for seam in ("task_delay", "message_delay", "RRFP_TEST", "monkeypatch", "fault_site"):
            if seam in text:
                found.append(f"{where} contains {seam!r}")
        if "time.sleep(" in text and _place(path) not in MAY_SLEEP:
            found.append(f"{where} sleeps")
        if "os.environ" in text and _place(path) not in MAY_READ_ENVIRONMENT:
            found.append(f"{where} reads the environment")
        for node in ast.walk(tree):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{where}:{node.lineno} imports {m}" for m in modules if m.split(".")[0] in TEST_ONLY_IMPORTS]
        bound = _bound_to_package(tree, _module_name(path), path)
        patched += [f"{where}:{line}: {ast.unparse(target)} ({bound[_root_name(target)]})"
                    for line, target in _assigned_attributes(tree) if _root_name(target) in bound]
    assert not found, found
    assert not patched, f"modules replacing this package's names at run time: {patched}"


def test_the_seam_check_sees_a_replaced_name():
    """The check above on the shapes it must refuse: a module attribute, a class's method, setattr."""
    source = ("from ..mcore import schedule\nfrom ..runtime.inbox import Inbox\nimport megatron_rrfp.runtime.executor\n"
              "def install():\n    schedule.dp_communication = None\n    Inbox.put, x = None, 1\n"
              "    setattr(megatron_rrfp.runtime.executor.PipelineIteration, 'run', None)\n    local.put = None\n")
    tree = ast.parse(source)
    bound = _bound_to_package(tree, "megatron_rrfp.bench.x", PACKAGE / "bench" / "x.py")
    hits = sorted(ast.unparse(t) for _, t in _assigned_attributes(tree) if _root_name(t) in bound)
    assert hits == ["Inbox.put", "megatron_rrfp.runtime.executor.PipelineIteration.?", "schedule.dp_communication"]
