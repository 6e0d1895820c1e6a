"""Prose that stays true: every module, name and path that a docstring, comment or doc names
exists; no docstring or comment carries an issue number, and the package's docstrings, comments,
warnings and error messages carry no measured figures (figures live in docs/*.md with the command
that produced them); no test is named after an issue.

Static: files are read and parsed (``ast``, ``tokenize``), nothing is imported or run.
"""
from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize
from collections.abc import Iterator
from functools import cache

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_rrfp"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists() or p.is_dir()
                     if not p.name.startswith("__"))

# Files other work is rewriting right now, whose prose still has something this test refuses;
# each entry is a path relative to the repository root (remove it when that work has landed).
PENDING: frozenset[str] = frozenset()


# ---------------------------------------------------------------- where prose is

def _python_files() -> list[pathlib.Path]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts)


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


@cache
def _docstrings(path: pathlib.Path) -> tuple[tuple[int, str], ...]:
    """(first line, text) of every docstring: the module's, a class's, a function's, and the
    string under a module- or class-level assignment (an attribute's docstring)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return tuple((node.lineno, node.value.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str))


@cache
def _comments(path: pathlib.Path) -> tuple[tuple[int, str], ...]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return tuple((t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT)


def _prose(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    """Every docstring and comment of a Python file, or every line of a Markdown file, with
    the line it starts on (a docstring's lines are numbered from its first)."""
    if path.suffix == ".md":
        yield from enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        return
    for start, text in (*_docstrings(path), *_comments(path)):
        for offset, line in enumerate(text.splitlines()):
            yield start + offset, line


# ---------------------------------------------------------------- names and paths resolve

@cache
def _names(path: pathlib.Path) -> dict[str, frozenset[str]]:
    """Names a module defines at top level, each mapped to the names its class body defines
    (empty for anything that is not a class)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: dict[str, frozenset[str]] = {}

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            nodes = node.targets if isinstance(node, ast.Assign) else [node.target]
            return [n.id for t in nodes for n in ast.walk(t) if isinstance(n, ast.Name)]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return [(a.asname or a.name).split(".")[0] for a in node.names]
        return []

    def body_names(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        for node in body:  # names bound under a top-level if/try (version switches) count too
            yield node
            if isinstance(node, (ast.If, ast.Try)):
                for part in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                             *[h.body for h in getattr(node, "handlers", [])]):
                    yield from body_names(part)

    for node in body_names(tree.body):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            # the package's lazily loaded names (its module __getattr__ serves them)
            names.update((k.value, frozenset()) for k in node.value.keys if isinstance(k, ast.Constant))
        members = frozenset()
        if isinstance(node, ast.ClassDef):
            members = frozenset(n for child in body_names(node.body) for n in targets(child))
        for name in targets(node):
            names[name] = members
    return names


def _dotted_resolves(dotted: str) -> bool:
    """A dotted name under megatron_rrfp: a module or package by its files, then at most a
    top-level name of it and a name of that class's body (deeper attributes are not checked)."""
    parts = dotted.split(".")
    here = ROOT / parts[0]
    rest = parts[1:]
    while rest and ((here / rest[0]).is_dir() or (here / f"{rest[0]}.py").is_file()):
        here = here / rest[0] if (here / rest[0]).is_dir() else here / f"{rest[0]}.py"
        rest = rest[1:]
    if not rest:
        return True
    module = here / "__init__.py" if here.is_dir() else here
    if not module.is_file():
        return False
    names = _names(module)
    if rest[0] not in names:
        return False
    return len(rest) == 1 or not names[rest[0]] or rest[1] in names[rest[0]]


def _path_resolves(text: str, base: pathlib.Path) -> bool:
    target = text.rstrip("/")
    if any(ch in target for ch in "*?["):
        return any(base.glob(target))
    return (base / target).exists() or (base / f"{target}.py").exists()


_DOTTED = re.compile(r"(?<![\w./-])megatron_rrfp(?:\.[A-Za-z_]\w*)+")
_ROOT_PATH = re.compile(r"(?<![\w./-])(?:megatron_rrfp|scripts|tests|docs)/[\w./*-]*[\w*/]")
_SUBPACKAGE = "|".join(SUBPACKAGES)
_PACKAGE_PATH = re.compile(rf"(?<![\w./-])(?:{_SUBPACKAGE})/[\w/*-]*\.py\b")
# `dist.` is torch.distributed's usual name and `train.py` a Megatron-LM script: not checked in short form
_SHORT_DOTTED = re.compile(r"(?<![\w./-])(?:{})(?:\.[a-z_]\w*)+".format("|".join(
    s for s in SUBPACKAGES if s not in ("dist", "train"))))
_MD_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)")

# A bare file name ("recorder.py") must name a file of this repository or one of these upstream files
# (Megatron-LM's and Transformer Engine's, which the prose names where it says what it wraps or follows).
UPSTREAM_FILES = frozenset({
    "pretrain_gpt.py", "pretrain_hybrid.py", "pretrain_vlm.py", "train.py", "training.py", "schedules.py",
    "p2p_communication.py", "utils.py", "gpt_builders.py", "model_provider.py", "clip_vit_model.py",
    "convert_llava_pretrain_to_wds.py", "dataloader_provider.py", "dataset_helpers.py", "layer_specs.py",
    "run_text_generation.py", "base.py", "linear.py", "quantization.py",
})
_BARE_FILE = re.compile(r"(?<![\w./-])[A-Za-z_]\w*\.py\b")


@cache
def _repo_file_names() -> frozenset[str]:
    return frozenset(p.name for p in _python_files())


_FILE_SUFFIXES = {"md", "json", "jsonl", "csv", "png", "svg", "txt", "log", "sh", "toml", "pt"}

# Modules that were renamed or folded into others: a mention of one is a pointer to nothing.
_FORMER_MODULES = re.compile(r"(?<![\w./-])(?:options\.(?:py\b|add_rrfp_arguments)|round_transport\b|"
                             r"megatron_lm_hooks\b|integration\.py\b)")


def _references(path: pathlib.Path) -> Iterator[tuple[int, str, bool]]:
    """(line, mention, resolves) for each module, name or path a file's prose names."""
    for line, text in _prose(path):
        for m in _DOTTED.finditer(text):
            dotted = m.group().removesuffix(".py")
            yield line, m.group(), _dotted_resolves(dotted)
        for m in _ROOT_PATH.finditer(text):
            yield line, m.group(), _path_resolves(m.group(), ROOT)
        for m in _PACKAGE_PATH.finditer(text):
            yield line, m.group(), _path_resolves(m.group(), PACKAGE)
        for m in _SHORT_DOTTED.finditer(text):
            dotted = m.group().removesuffix(".py")
            if dotted.rpartition(".")[2] not in _FILE_SUFFIXES:
                yield line, m.group(), _dotted_resolves(f"megatron_rrfp.{dotted}")
        for m in _BARE_FILE.finditer(text):
            yield line, m.group(), m.group() in _repo_file_names() or m.group() in UPSTREAM_FILES
        for m in _FORMER_MODULES.finditer(text):
            yield line, m.group(), False
        if path.suffix == ".md":
            for m in _MD_LINK.finditer(text):
                yield line, m.group(1), _path_resolves(m.group(1), path.parent)


def _dangling() -> list[str]:
    bad = []
    for path in [*_python_files(), *_markdown_files()]:
        if _rel(path) in PENDING:
            continue
        for line, mention, ok in _references(path):
            if not ok:
                bad.append(f"{_rel(path)}:{line}: {mention}")
    return bad


def test_every_module_name_and_path_in_docstrings_comments_and_docs_exists():
    bad = _dangling()
    assert not bad, "names or paths that do not exist (renamed or moved?):\n" + "\n".join(bad)


def test_the_reference_check_catches_a_moved_module_and_a_missing_name():
    assert _dotted_resolves("megatron_rrfp.runtime.executor")
    assert _dotted_resolves("megatron_rrfp.mcore.compat")
    assert _dotted_resolves("megatron_rrfp.policy.actions.Kind.F")
    assert not _dotted_resolves("megatron_rrfp.schedule")
    assert not _dotted_resolves("megatron_rrfp.runtime.round_transport")
    assert not _dotted_resolves("megatron_rrfp.policy.actions.NoSuchName")
    assert not _dotted_resolves("megatron_rrfp.policy.actions.Kind.NO_SUCH_KIND")
    assert _path_resolves("mcore/compat.py", PACKAGE) and not _path_resolves("megatron_rrfp/train.py", ROOT)
    assert [m.group() for m in _PACKAGE_PATH.finditer("see mcore/compat.py and core/schedules.py")] == [
        "mcore/compat.py"]


# ---------------------------------------------------------------- no issue numbers, no measured figures

# The word issue with a number after it, or a hash and a number; upstream Megatron-LM threads keep
# theirs (written "Megatron-LM" then the hash and number).
_ISSUE = re.compile(r"\bissues?[\s-]*#?\d+|(?<![\w&#])(?<!Megatron-LM )(?<!megatron-lm )#\d+\b", re.IGNORECASE)

# A measured figure: a speed ratio, a percentage, a measured time. Buffer limits are multiples too
# ("1x", "1.25x", "1.5x", "2x-4x") and are settings, not measurements; a multiple counts as a
# figure when a limit cannot be it: below 1x, a range with decimals, two decimals other than a
# quarter (1.10x, 0.995x), "up to 2x", or beside a word that compares ("1.3x faster", "1.2x over").
_R = r"\d+(?:\.\d+)?\s?[x×]"
_FIGURE = re.compile("|".join([
    r"(?<![\w.])0\.\d+(?:\s?-\s?\d+(?:\.\d+)?)?\s?[x×](?!\w)",
    r"(?<![\w.])\d+\.\d+\s?-\s?\d+\.\d+\s?[x×](?!\w)",
    r"(?<![\w.])\d+\.(?!(?:25|50|75)\s?[x×])\d{2,}\s?[x×](?!\w)",
    rf"\b(?:up\s+to|by)\s+{_R}(?!\w)",
    rf"(?<![\w.]){_R}\s+(?:faster|slower|speed-?ups?|over|than|against)\b",
    rf"\bspeed-?ups?\s*[:=]\s*{_R}",
    r"(?<![\w.])\d+(?:\.\d+)?\s?%",
    r"\b(?:measured|took|takes|ran\s+in)\W+(?:\w+\W+){0,3}\d+(?:\.\d+)?\s?(?:ms|s|min|µs)\b",
]), re.IGNORECASE)


def _package_prose() -> Iterator[tuple[str, int, str]]:
    for path in _python_files():
        if path.is_relative_to(PACKAGE) and _rel(path) not in PENDING:
            for line, text in _prose(path):
                yield _rel(path), line, text


def _issue_mentions() -> list[str]:
    """Issue numbers in the package's docstrings, and in every comment and docstring of the
    package, scripts/ and tests/: a reader needs the reason, not a tracker's number."""
    bad = []
    for path in _python_files():
        if _rel(path) in PENDING:
            continue
        for line, text in _prose(path):
            bad += [f"{_rel(path)}:{line}: {m.group()}" for m in _ISSUE.finditer(text)]
    return bad


def test_no_issue_numbers_in_docstrings_or_comments():
    bad = _issue_mentions()
    assert not bad, "say the reason instead of the issue's number:\n" + "\n".join(bad)


# Calls whose string arguments a user reads as a message: warnings.warn, a logger's warning / error,
# and the exception a raise builds.
_MESSAGE_CALLS = frozenset({"warn", "warning", "error", "critical", "exception"})


def _message_strings(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    """The constant text (an f-string's literal parts too) of every warning, logged error and raised
    exception's message in a file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        call = node.exc if isinstance(node, ast.Raise) else node
        if not isinstance(call, ast.Call):
            continue
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if isinstance(node, ast.Raise) or name in _MESSAGE_CALLS:
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                yield from ((n.lineno, n.value) for n in ast.walk(arg)
                            if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _package_messages() -> Iterator[tuple[str, int, str]]:
    for path in _python_files():
        if path.is_relative_to(PACKAGE) and _rel(path) not in PENDING:
            for line, text in _message_strings(path):
                yield _rel(path), line, text


def test_no_measured_figures_in_the_packages_docstrings_comments_or_messages():
    bad = [f"{file}:{line}: {m.group()}" for file, line, text in [*_package_prose(), *_package_messages()]
           for m in _FIGURE.finditer(text)]
    assert not bad, ("a measured figure belongs in docs/*.md beside the command that produced it:\n"
                     + "\n".join(bad))


def test_the_prose_patterns_tell_figures_and_issue_numbers_from_settings():
    figures = ["0.12x of Megatron's interleaved schedule", "1.10x vs 0.71x", "bfw 1.03-1.17x over zbh1",
               "the waiting order 0.995-1.003x", "loses up to 2x at Megatron's memory", "1.3x faster than 1f1b",
               "speedup: 1.2x", "up to 6.8%", "12% faster", "measured it at 41 ms", "the step took 3.4 s"]
    settings = ["the 1x and 1.5x limits", "at 1.25x bf leads", "at 2x-4x", "--buffer-limit 1x,1.25x,1.5x,2x,4x",
                "'12 (1.5x Megatron's 8)'", "2x the activations", "hidden 4096, seq 2048", "within 8 minutes",
                "TP=2 x PP=2", "after 300 s"]
    assert [s for s in figures if not _FIGURE.search(s)] == []
    assert [s for s in settings if _FIGURE.search(s)] == []
    assert all(_ISSUE.search(s) for s in ["issue 31", "(issue-30)", "Issues 10 and 14", "see #27"])
    assert not any(_ISSUE.search(s) for s in ["Megatron-LM #1234", "issued by rank 0", "&#39;", "colour #55A868"])


def test_the_message_check_reads_warnings_logged_errors_and_raised_exceptions(tmp_path):
    source = tmp_path / "messages.py"
    source.write_text("import warnings\n"
                      "warnings.warn(f'hint {name!r} is slower (simulated 0.70-0.98x)', RuntimeWarning)\n"
                      "log.warning('the step took 3.4 s')\n"
                      "raise ValueError(f'--buffer-limit {x}: ' 'measured at 41 ms')\n"
                      "print('12% faster')\n", encoding="utf-8")
    found = {m.group() for _, text in _message_strings(source) for m in _FIGURE.finditer(text)}
    assert found == {"0.70-0.98x", "took 3.4 s", "measured at 41 ms"}  # not the print's line


# ---------------------------------------------------------------- module docstrings say what and why

MAX_MODULE_DOCSTRING_LINES = 50
"""A module docstring says what the module does and why, in a few lines; a longer argument
(why a protocol cannot deadlock, why a rule is safe) is a page of docs/design/."""

# The B/W split's module is being moved into its own folder; its argument moves with it.
LONG_DOCSTRING_PENDING = frozenset({"megatron_rrfp/mcore/wgrad.py", "megatron_rrfp/split/megatron_linear.py"})


def test_module_docstrings_say_what_and_why_in_a_few_lines():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if _rel(path) in PENDING or _rel(path) in LONG_DOCSTRING_PENDING:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if doc and doc.count("\n") + 1 > MAX_MODULE_DOCSTRING_LINES:
            long[_rel(path)] = doc.count("\n") + 1
    assert not long, f"over {MAX_MODULE_DOCSTRING_LINES} lines (move the argument to docs/design/): {long}"


# ---------------------------------------------------------------- test names

def test_no_test_is_named_after_an_issue():
    bad = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    node.name.lower().startswith("test") and re.search(r"issue_?\d", node.name.lower()):
                bad.append(f"{_rel(path)}:{node.lineno}: {node.name}")
    assert not bad, "name a test after what it shows, not after an issue:\n" + "\n".join(bad)
