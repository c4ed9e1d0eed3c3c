"""docs/troubleshooting.md lists exactly what the code can say.

The reasons the operator sets (condition reasons, Event reasons) are collected from its
source with an AST scan, never imported: a reason added, renamed or removed in
`operator/shardcache_operator/*.py` fails here until the guide's tables follow. The
same holds for the phases and condition types (`status.py`), the sidecar's readiness
gates, the client's error classes (`shardcache/errors.py`) and the messages the guide
quotes.

What the scan counts as a reason, in every module of the operator package:
- a string passed as the `reason=` keyword of any call (`kopf.event`, `kopf.info`,
  `kube.event_body`, ...);
- the second positional argument of `Failed(...)` (`status.Failed`: a condition reason
  and, through `reconcile._events`, a Warning Event's), of `Event(...)`
  (`reconcile.Event`) and of `say(...)` (`manifest_backfill.Say`);
- the third positional argument of `Condition(...)` (`status.Condition`);
- the second item of a `("Warning" | "Normal", reason, message)` tuple
  (`sample_room.capacity`);
- module-level constants named `REASON`, `*_REASON` or `REASON_*`.
A string there is a literal, a conditional expression of literals, a module constant
(`CHECKS_BUSY`, `sidecar_health.OOM_KILLED`) or a local variable of the enclosing
function assigned one of those; anything else (a reason read from an object at run
time) is not a reason of its own, only one of those it carries.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "troubleshooting.md"
OPERATOR = ROOT / "operator" / "shardcache_operator"
SIDECAR = ROOT / "sidecar" / "shardcache_sidecar"
ERRORS = ROOT / "shardcache" / "errors.py"
RULES = ROOT / "helm" / "shardcache" / "templates" / "monitoring.yaml"

#: Calls whose positional argument at this index is a reason (by the called name).
REASON_ARGUMENT = {"Failed": 1, "Event": 1, "say": 1, "Condition": 2}
#: First header cells of the guide's tables, by what their first column lists.
REASON_HEADERS = ("reason", "event reason")
CONDITION_HEADER = "condition"
PHASE_HEADER = "phase"
GATE_HEADER = "gate"
ERROR_HEADER = "error"
ALERT_HEADER = "alert"
#: A reason, a condition type, a phase or an error class, backquoted.
CAMEL_TOKEN = re.compile(r"`([A-Z][A-Za-z0-9]*)`")
#: A readiness gate, backquoted (`tiers`, `checkpoint-restore`).
GATE_TOKEN = re.compile(r"`([a-z][a-z0-9-]*)`")

#: Messages the guide quotes, with the file that says them: each must be in one string
#: literal there (a piece of an f-string between its fields counts).
QUOTED = (
    (
        "sidecar/shardcache_sidecar/server/lifecycle.py",
        "is neither in the node disk tier nor handed by the operator",
    ),
    (
        "sidecar/shardcache_sidecar/server/lifecycle.py",
        "the object store refused the credentials in",
    ),
    ("sidecar/shardcache_sidecar/server/lifecycle.py", "the dataset source is unusable:"),
    ("sidecar/shardcache_sidecar/server/lifecycle.py", "the dataset changed since it was pinned"),
    ("sidecar/shardcache_sidecar/server/lifecycle.py", "more than the whole memory tier holds"),
    ("sidecar/shardcache_sidecar/server/lifecycle.py", "cannot be decoded here:"),
    ("sidecar/shardcache_sidecar/server/lifecycle.py", "does not fit beside them"),
    ("sidecar/shardcache_sidecar/server/lifecycle.py", "resident failed:"),
    ("operator/shardcache_operator/admission.py", "the operator has not resolved its manifest yet"),
    ("operator/shardcache_operator/admission.py", "does not exist: create it, or remove"),
    ("operator/shardcache_operator/admission.py", "is not Ready (generation"),
    ("operator/shardcache_operator/admission.py", "it will not be Ready again"),
    (
        "operator/shardcache_operator/admission.py",
        "no free port for its sidecar's probes and metrics in",
    ),
    ("operator/shardcache_operator/admission.py", "cannot inject DatasetMount"),
    ("operator/shardcache_operator/admission.py", "the pod cannot be admitted:"),
    ("operator/shardcache_operator/webhook.py", "the UID of namespace"),
    ("operator/shardcache_operator/job_pins.py", "were injected by a webhook from before job pins"),
    ("operator/shardcache_operator/job_pins.py", "already read different datasets of it"),
    ("operator/shardcache_operator/job_pins.py", "read cannot be recovered"),
    ("operator/shardcache_operator/resolve_slots.py", "are all busy, not the source"),
    ("operator/shardcache_operator/source_reads.py", "reads of its sources running"),
    ("operator/shardcache_operator/reconcile.py", "failed unexpectedly"),
    ("operator/shardcache_operator/reconcile.py", "not checked:"),
    ("operator/shardcache_operator/sources.py", "the pinned data is gone"),
    ("operator/shardcache_operator/health.py", "ready (webhook only):"),
    (
        "operator/shardcache_operator/crd_version.py",
        "kubectl apply --server-side --force-conflicts -f <chart>/crds/",
    ),
    ("operator/shardcache_operator/event_gates.py", "since the last such Event"),
    ("shardcache/source.py", "the object changed after the manifest was resolved"),
    (
        "shardcache/source.py",
        "it was deleted or moved after the manifest was resolved; restore it, or re-pin the dataset",
    ),
    (
        "shardcache/sidecar_client.py",
        "check that the sidecar container is running and read its log",
    ),
)

#: name -> the expressions assigned to it (module constants, or a function's locals).
Assignments = dict[str, list[ast.expr]]


def module_constants(tree: ast.Module) -> Assignments:
    """Module-level `NAME = value` (and `NAME: type = value`) of a module."""
    found: Assignments = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            found.setdefault(target.id, []).append(value)
    return found


def local_assignments(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Assignments:
    """`name = value` anywhere in `function`'s body."""
    found: Assignments = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(node.value)
    return found


class Package:
    """The modules of one package, parsed, and their module constants."""

    def __init__(self, directory: Path) -> None:
        self.trees = {
            path.stem: ast.parse(path.read_text()) for path in sorted(directory.glob("*.py"))
        }
        self.constants = {name: module_constants(tree) for name, tree in self.trees.items()}

    def strings(
        self, expr: ast.expr, module: str, scopes: Sequence[Assignments] = (), depth: int = 0
    ) -> set[str]:
        """The strings `expr` can be, where the source says them (the module docstring)."""
        if depth > 8:
            return set()
        if isinstance(expr, ast.Constant):
            return {expr.value} if isinstance(expr.value, str) else set()
        if isinstance(expr, ast.IfExp):
            return self.strings(expr.body, module, scopes, depth + 1) | self.strings(
                expr.orelse, module, scopes, depth + 1
            )
        if isinstance(expr, ast.Name):
            for scope in reversed(scopes):
                if expr.id in scope:
                    return self.union(scope[expr.id], module, (), depth)
            return self.union(self.constants[module].get(expr.id, []), module, (), depth)
        if (
            isinstance(expr, ast.Attribute)
            and isinstance(expr.value, ast.Name)
            and expr.value.id in self.constants
        ):
            other = expr.value.id
            return self.union(self.constants[other].get(expr.attr, []), other, (), depth)
        return set()

    def union(
        self, exprs: Iterable[ast.expr], module: str, scopes: Sequence[Assignments], depth: int
    ) -> set[str]:
        found: set[str] = set()
        for expr in exprs:
            found |= self.strings(expr, module, scopes, depth + 1)
        return found


class _ReasonScan(ast.NodeVisitor):
    """The reason sites of one module (the module docstring), with where each is."""

    def __init__(self, package: Package, module: str) -> None:
        self.package = package
        self.module = module
        self.scopes: list[Assignments] = []
        self.found: dict[str, set[str]] = {}

    def _add(self, expr: ast.expr, site: str, line: int) -> None:
        for reason in self.package.strings(expr, self.module, self.scopes):
            self.found.setdefault(reason, set()).add(f"{self.module}.py:{line} {site}")

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scopes.append(local_assignments(node))
        self.generic_visit(node)
        self.scopes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._function(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        for keyword in node.keywords:
            if keyword.arg == "reason":
                self._add(keyword.value, f"{called}(reason=...)", node.lineno)
        index = REASON_ARGUMENT.get(called)
        if index is not None and len(node.args) > index:
            argument = node.args[index]
            if not isinstance(argument, ast.Starred):
                self._add(argument, f"{called}(...) argument {index}", node.lineno)
        self.generic_visit(node)

    def visit_Tuple(self, node: ast.Tuple) -> None:
        first = node.elts[0] if node.elts else None
        if (
            len(node.elts) == 3
            and isinstance(first, ast.Constant)
            and first.value in ("Warning", "Normal")
        ):
            self._add(node.elts[1], f"({first.value!r}, reason, message)", node.lineno)
        self.generic_visit(node)


def is_reason_constant(name: str) -> bool:
    return name == "REASON" or name.endswith("_REASON") or name.startswith("REASON_")


def operator_reasons(package: Package) -> dict[str, set[str]]:
    """Every reason the operator's code can set, with the sites that set it."""
    found: dict[str, set[str]] = {}
    for module, tree in package.trees.items():
        scan = _ReasonScan(package, module)
        scan.visit(tree)
        for reason, sites in scan.found.items():
            found.setdefault(reason, set()).update(sites)
        for name, values in package.constants[module].items():
            if is_reason_constant(name):
                for reason in package.union(values, module, (), 0):
                    found.setdefault(reason, set()).add(f"{module}.{name}")
    return found


def condition_types(package: Package) -> set[str]:
    """status.CONDITION_TYPES, each resolved to its string."""
    (value,) = package.constants["status"]["CONDITION_TYPES"]
    assert isinstance(value, ast.Tuple)
    found: set[str] = set()
    for element in value.elts:
        found |= package.strings(element, "status")
    return found


def phases(package: Package) -> set[str]:
    """The values of status.Phase."""
    (phase,) = (
        node
        for node in package.trees["status"].body
        if isinstance(node, ast.ClassDef) and node.name == "Phase"
    )
    return {
        node.value.value
        for node in phase.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def sidecar_gates() -> set[str]:
    """The sidecar's readiness gates: module constants named GATE_* or *_GATE."""
    found: set[str] = set()
    for path in SIDECAR.rglob("*.py"):
        for name, values in module_constants(ast.parse(path.read_text())).items():
            if name.startswith("GATE_") or name.endswith("_GATE"):
                found |= {
                    v.value
                    for v in values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)
                }
    return found


def client_errors() -> set[str]:
    """The error classes of shardcache/errors.py: ShardcacheError and its subclasses."""
    classes = {
        node.name: {base.id for base in node.bases if isinstance(base, ast.Name)}
        for node in ast.parse(ERRORS.read_text()).body
        if isinstance(node, ast.ClassDef)
    }
    found = {"ShardcacheError"}
    grew = True
    while grew:
        more = {name for name, bases in classes.items() if bases & found} - found
        found |= more
        grew = bool(more)
    return found


Table = tuple[list[str], list[list[str]]]


def tables(text: str) -> list[Table]:
    """The markdown tables of `text`: (header cells, row cells), separator left out."""
    found: list[Table] = []
    lines: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            lines.append(line)
            continue
        if len(lines) >= 2:
            cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in lines]
            found.append((cells[0], cells[2:]))
        lines = []
    return found


def first_column(text: str, headers: Iterable[str], token: re.Pattern[str]) -> set[str]:
    """The backquoted tokens in the first cell of every row of the tables whose first
    header cell is one of `headers`."""
    wanted = set(headers)
    found: set[str] = set()
    for header, rows in tables(text):
        if header and header[0].lower() in wanted:
            for row in rows:
                found.update(token.findall(row[0]))
    return found


def literal_pieces(tree: ast.AST) -> list[str]:
    """Every string literal of a module; an f-string's pieces between its fields."""
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


@pytest.fixture(scope="module")
def operator_package() -> Package:
    return Package(OPERATOR)


@pytest.fixture(scope="module")
def reasons(operator_package: Package) -> dict[str, set[str]]:
    return operator_reasons(operator_package)


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def missing_text(missing: Iterable[str], sites: Mapping[str, set[str]]) -> str:
    return "; ".join(
        f"{name} (set at {', '.join(sorted(sites[name]))})" for name in sorted(missing)
    )


def test_the_scan_finds_reasons_of_each_kind_of_site(reasons: Mapping[str, set[str]]) -> None:
    # One reason per kind of site the scan reads, so a scan that stops seeing one
    # fails here rather than letting the guide's check pass on fewer reasons.
    expected = {
        "SecretForbidden": "Failed(...) argument 1",  # a literal
        "ChecksBusy": "Failed(...) argument 1",  # a module constant
        "NotAllowed": "authority.REASON",  # a constant named REASON
        "SourceRecovered": "Event(...) argument 1",
        "ManifestHanded": "say(...) argument 1",
        "SidecarOOMKilled": "Condition(...) argument 2",  # a conditional of constants
        "WithinDecodeRoom": "Condition(...) argument 2",  # a local variable
        "DataRecovered": "event(reason=...)",  # a conditional keyword
        "SampleWindowsDoNotFit": "('Warning', reason, message)",
        "JobPinUnknown": "admission.REASON_JOB_PIN_UNKNOWN",
        "SkipApplied": "skips.EVENT_REASON",
        "CRDOutdated": "crd_version.REASON",
    }
    for reason, site in expected.items():
        assert any(site in found for found in reasons.get(reason, ())), (
            f"{reason} not found at a site like {site!r}: {sorted(reasons.get(reason, ()))}"
        )


def test_the_scan_collects_reasons_only(reasons: Mapping[str, set[str]]) -> None:
    # Reasons are CamelCase words: a kind, a phrase or a label value caught by a
    # looser scan would show here.
    odd = {reason for reason in reasons if not re.fullmatch(r"[A-Z][A-Za-z0-9]+", reason)}
    assert not odd, missing_text(odd, reasons)


def test_every_reason_the_operator_sets_is_in_a_reason_table_of_the_guide(
    reasons: Mapping[str, set[str]], doc: str
) -> None:
    listed = first_column(doc, REASON_HEADERS, CAMEL_TOKEN)
    missing = set(reasons) - listed
    assert not missing, (
        f"docs/troubleshooting.md lists no row for: {missing_text(missing, reasons)}"
    )


def test_every_reason_the_guide_lists_is_one_the_operator_sets(
    reasons: Mapping[str, set[str]], doc: str
) -> None:
    listed = first_column(doc, REASON_HEADERS, CAMEL_TOKEN)
    unknown = listed - set(reasons)
    assert not unknown, (
        f"docs/troubleshooting.md lists reasons the code never sets: {sorted(unknown)}"
    )


def test_the_guide_lists_exactly_the_condition_types(operator_package: Package, doc: str) -> None:
    assert first_column(doc, [CONDITION_HEADER], CAMEL_TOKEN) == condition_types(operator_package)


def test_the_guide_lists_exactly_the_phases(operator_package: Package, doc: str) -> None:
    assert first_column(doc, [PHASE_HEADER], CAMEL_TOKEN) == phases(operator_package)


def test_the_guide_lists_exactly_the_sidecars_readiness_gates(doc: str) -> None:
    gates = sidecar_gates()
    assert {"tiers", "manifest", "warm", "checkpoint-restore"} <= gates
    assert first_column(doc, [GATE_HEADER], GATE_TOKEN) == gates


def test_the_guide_lists_exactly_the_clients_error_classes(doc: str) -> None:
    assert first_column(doc, [ERROR_HEADER], CAMEL_TOKEN) == client_errors()


@pytest.mark.parametrize(("path", "phrase"), QUOTED, ids=[phrase for _, phrase in QUOTED])
def test_a_message_the_guide_quotes_is_said_by_the_code(path: str, phrase: str, doc: str) -> None:
    assert phrase in " ".join(doc.split()), f"docs/troubleshooting.md no longer quotes {phrase!r}"
    pieces = literal_pieces(ast.parse((ROOT / path).read_text()))
    assert any(phrase in piece for piece in pieces), f"{path} no longer says {phrase!r}"


def test_the_guide_lists_exactly_the_charts_alerts(doc: str) -> None:
    alerts = set(re.findall(r"^\s*- alert: (\w+)\s*$", RULES.read_text(), re.MULTILINE))
    assert alerts
    assert first_column(doc, [ALERT_HEADER], CAMEL_TOKEN) == alerts


#: A reference to a heading of another page: docs/operator.md, "Upgrading".
HEADING_REFERENCE = re.compile(r'docs/([a-z-]+\.md), "([^"]+)"')
#: A reference to a paragraph led by a bold phrase: docs/operator.md, **Pinning**.
PARAGRAPH_REFERENCE = re.compile(r"docs/([a-z-]+\.md), \*\*([^*]+)\*\*")


def test_every_heading_the_guide_points_to_exists(doc: str) -> None:
    references = HEADING_REFERENCE.findall(" ".join(doc.split()))
    assert references
    for page, heading in references:
        text = (ROOT / "docs" / page).read_text()
        pattern = rf"^#+ {re.escape(heading)}\s*$"
        assert re.search(pattern, text, re.MULTILINE), f"docs/{page} has no heading {heading!r}"


def test_every_paragraph_the_guide_points_to_exists(doc: str) -> None:
    references = PARAGRAPH_REFERENCE.findall(" ".join(doc.split()))
    assert references
    for page, lead in references:
        text = (ROOT / "docs" / page).read_text()
        assert f"**{lead}.**" in text or f"**{lead}**" in text, (
            f"docs/{page} has no paragraph led by **{lead}**"
        )


def test_the_guide_is_in_the_readmes_documentation_list() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "- [docs/troubleshooting.md](docs/troubleshooting.md):" in readme
