"""The DAG is honest: every stage depends on every project file it imports (transitively) and on
exactly the params it reads, so no edit of code or params can leave a stale output behind."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from detectors.config import StageParams, read_params
from detectors.errors import InputError
from pipelines._provenance import PACKAGES, dvc_yaml, ordered_stages, stage_closure


def stages() -> dict[str, dict]:
    """dvc.yaml's stages by name, each as it runs (a ``foreach`` stage's ``do``)."""
    return {name: s.get("do", s) for name, s in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items()}


def stage_module(stage: dict) -> str:
    cmd = stage["cmd"].split()
    assert cmd[:2] == ["python", "-m"] and cmd[2].startswith("pipelines."), f"unexpected cmd {stage['cmd']!r}"
    return cmd[2]


def code_deps(stage: dict) -> list[Path]:
    return [Path(d) for d in stage["deps"] if Path(d).parts[0] in PACKAGES]


@pytest.mark.parametrize("name", sorted(stages()))
def test_stage_depends_on_exactly_the_code_it_imports(name):
    stage = stages()[name]
    closure = stage_closure(stage_module(stage))
    deps = code_deps(stage)
    missing = sorted(str(f) for f in closure if not any(f == d or d in f.parents for d in deps))
    assert not missing, f"dvc.yaml stage {name} misses deps on files it imports: {missing}"
    for dep in deps:
        files = {p.relative_to(ROOT) for p in (ROOT / dep).rglob("*.py")} if (ROOT / dep).is_dir() else {dep}
        assert files, f"stage {name}: dep {dep} does not exist"
        unused = sorted(str(f) for f in files - closure)
        assert not unused, (
            f"stage {name}: dep {dep} covers files the stage never imports {unused} (they would rerun it)"
        )


def test_dvc_yaml_is_what_the_command_writes():
    assert (ROOT / "dvc.yaml").read_text() == dvc_yaml(), "dvc.yaml is stale: run python -m pipelines._provenance"


def test_an_edit_of_a_stage_modules_declarations_is_what_dvc_yaml_then_says(tmp_path):
    """dvc.yaml follows the modules: a new out in ``OUTS`` and a new params key in ``READS`` show in the stage's
    entry, and nothing else moves; a malformed entry is one error naming the module, the section and the entry."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "params.yaml", tmp_path)  # the foreach tables, paths and the sections rag_eval's params name
    module = tmp_path / "pipelines/prepare_articles.py"
    source = module.read_text()
    module.write_text(
        source.replace(
            "OUTS = (\n", 'OUTS = (\n    ("${paths.articles}.sample", {"cache": False}, "a sample"),\n', 1
        ).replace("READS = (", 'READS = (\n    "qa.limit",', 1)
    )
    before, after = yaml.safe_load(dvc_yaml()), yaml.safe_load(dvc_yaml(tmp_path))
    assert after["stages"]["prepare_articles"]["outs"][0] == {"${paths.articles}.sample": {"cache": False}}
    assert after["stages"]["prepare_articles"]["params"] == [
        "qa.limit",
        *before["stages"]["prepare_articles"]["params"],
    ]
    assert "      - ${paths.articles}.sample:   # a sample\n          cache: false\n" in dvc_yaml(tmp_path)
    del after["stages"]["prepare_articles"], before["stages"]["prepare_articles"]
    assert after == before
    module.write_text(source.replace("OUTS = (\n", 'OUTS = (\n    ("${paths.articles}.sample", {"cache": "no"}),\n', 1))
    with pytest.raises(
        InputError, match=r"pipelines/prepare_articles.py OUTS: entry .*cache.*'no'.* write one of those"
    ):
        dvc_yaml(tmp_path)


def as_written(entry) -> dict | str:
    """A declared entry (``path``, ``(path, options)``, ``(path, options, note)``) as dvc.yaml's YAML reads back."""
    return entry if isinstance(entry, str) else {entry[0]: entry[1]}


@pytest.mark.parametrize("name", ordered_stages())
def test_each_stage_is_its_modules_declarations_and_its_params_exactly_what_it_reads(name):
    """The entry of ``name`` is what its module declares (imported here, read from source by the command): the
    params DVC watches are the keys StageParams lets it read, and its data deps, outs, metrics and plots."""
    stage, module = stages()[name], importlib.import_module(f"pipelines.{name}")
    foreach = getattr(module, "FOREACH", None)  # DVC's foreach over that params table, one run per key
    assert stage["cmd"] == f"python -m pipelines.{name}" + (" --item ${key}" if foreach else "")
    entry = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][name]
    assert entry.get("foreach") == (f"${{{foreach}}}" if foreach else None)
    assert stage["params"] == list(StageParams(read_params(ROOT / "params.yaml"), module.READS, name).reads)
    assert stage["deps"][len(stage["deps"]) - len(getattr(module, "DEPS", ())) :] == list(getattr(module, "DEPS", ()))
    assert all(
        Path(d).parts[0] in PACKAGES for d in stage["deps"][: len(stage["deps"]) - len(getattr(module, "DEPS", ()))]
    )
    for key in ("outs", "metrics", "plots"):
        assert stage.get(key, []) == [as_written(e) for e in getattr(module, key.upper(), ())], (name, key)


def test_closure_follows_imports_inside_functions_but_not_lazy_package_attributes():
    closure = stage_closure("detectors.registry.kinds")
    assert Path("detectors/ctrla/registered.py") in closure  # imported inside detector_class()
    assert Path("detectors/inference.py") not in stage_closure("pipelines.prepare")  # detectors.__getattr__ only


def test_every_stage_module_is_in_the_dag():
    modules = {stage_module(s) for s in stages().values()}
    on_disk = {f"pipelines.{p.stem}" for p in (ROOT / "pipelines").glob("*.py") if not p.stem.startswith("_")}
    assert on_disk == modules


def test_a_new_stage_is_its_module_placed_after_what_it_reads(tmp_path):
    """No list names the stages: a module added under ``pipelines/`` is a stage of dvc.yaml, placed after every stage
    whose outputs it reads and before those that read its own; stages that read each other are one error."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "params.yaml", tmp_path)  # what a foreach stage (register) runs over, and the paths
    (tmp_path / "pipelines/audit.py").write_text(
        'DEPS = ("${paths.registry}", "${paths.qa}")\nOUTS = ("${paths.registry}.audit",)\n'
    )
    order = ordered_stages(tmp_path)
    assert set(order) == {*ordered_stages(), "audit"} and order.index("audit") > order.index("register")
    assert "  audit:\n    cmd: python -m pipelines.audit\n" in dvc_yaml(tmp_path)
    reads = {n: s.get("do", s) for n, s in yaml.safe_load(dvc_yaml(tmp_path))["stages"].items()}
    for name, stage in reads.items():  # every stage after the stages whose outputs it reads
        for other in order[order.index(name) :]:
            outs = _declared_files(reads[other]) - set(reads[other].get("deps", []))
            assert not outs & set(stage.get("deps", [])), (name, other)
    prepare = tmp_path / "pipelines/prepare.py"
    prepare.write_text(prepare.read_text() + '\nDEPS = ("${paths.registry}.audit",)\n')
    with pytest.raises(InputError, match=r"stages \[.*'audit'.*'prepare'.*\] read each other's outputs"):
        ordered_stages(tmp_path)


def _declared_files(stage: dict) -> set[str]:
    """Every path a stage names as a dep, out, metric or plot (templated, e.g. ``${paths.qa}``)."""
    names = set(stage.get("deps", []))
    for key in ("outs", "metrics", "plots"):
        names |= {next(iter(e)) if isinstance(e, dict) else e for e in stage.get(key, [])}
    return names


@pytest.mark.parametrize("name", sorted(stages()))
def test_every_path_a_stage_reads_is_a_dep_or_an_out(name):
    """A path key in READS is data the stage reads or writes: dvc.yaml must name it, or DVC cannot see it.

    ``paths.raw`` is the exception: a download cache whose content is fixed by the pinned archive version
    in ``detectors/sources/bigbench.py`` (a code dep of the stages that read it); prepare and
    evaluate_directions each unpack the task files they need into it, so it cannot be one stage's out.
    """
    stage = stages()[name]
    reads = importlib.import_module(stage_module(stage)).READS
    named = _declared_files(stage)
    paths = [key for key in reads if key.startswith("paths.") and key != "paths.raw"]
    missing = [key for key in paths if not any(n.startswith("${" + key + "}") for n in named)]
    assert not missing, f"dvc.yaml stage {name} reads {missing} but names them in no dep, out, metric or plot"


def import_graph(root: Path = ROOT, package: str = "detectors", registered: bool = True) -> dict[str, set[str]]:
    """The library's modules and the modules of it each imports (imports inside functions included; a module's own
    packages left out; the entries of lazy registries too unless ``registered`` is False), read from the sources."""
    from detectors.imports import imported_modules, module_file

    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (root / package).rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in imported_modules(path, registered=registered):
            while imported and imported not in modules:  # a name imported from a module: the module
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + ".") and module_file(imported, root):
                deps.add(imported)
        graph[name] = deps
    return graph


def package_graph(root: Path = ROOT, package: str = "detectors") -> dict[str, set[str]]:
    """:func:`import_graph` folded onto ``package``'s first level (``detectors.rag``, ``detectors.cli``, ...): which of
    its sub-packages and top-level modules import which. A lazy registry's entries are not imports: the registry names
    its kinds by string precisely so that it does not import them (``detectors.registry.kinds`` finds the detector
    classes of ``dior``, ``ctrla`` and ``utility`` in the sources, and they import ``registry.artifact``)."""
    top = len(package.split(".")) + 1
    graph: dict[str, set[str]] = {}
    for name, deps in import_graph(root, package, registered=False).items():
        if name == package:
            continue
        first = ".".join(name.split(".")[:top])
        graph.setdefault(first, set()).update(".".join(d.split(".")[:top]) for d in deps if d != package)
        graph[first].discard(first)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[name] = 2
        return None

    return next((c for name in sorted(graph) if name not in state and (c := visit(name, [name]))), None)


def test_the_library_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_library_packages_import_each_other_without_a_cycle():
    """Layering: no two first-level packages of ``detectors`` depend on each other, even through imports inside
    functions (evaluation below the detector packages, utility below rag, ...)."""
    cycle = find_cycle(package_graph())
    assert cycle is None, "package import cycle: " + " -> ".join(cycle or [])


def test_the_package_graph_sees_an_import_inside_a_function(tmp_path):
    lib = tmp_path / "lib"
    for sub, body in {
        "a": "def f():\n    from lib.b.y import g\n",
        "b": "from lib.c.z import h\n",
        "c": "import lib.a.x\n",
    }.items():
        (lib / sub).mkdir(parents=True)
        (lib / sub / "__init__.py").write_text("")
        (lib / sub / f"{'xyz'['abc'.index(sub)]}.py").write_text(body)
    (lib / "__init__.py").write_text("")
    assert package_graph(tmp_path, "lib") == {"lib.a": {"lib.b"}, "lib.b": {"lib.c"}, "lib.c": {"lib.a"}}
    assert find_cycle(package_graph(tmp_path, "lib")) == ["lib.a", "lib.b", "lib.c", "lib.a"]


def test_validating_the_rag_sections_reads_the_registries_names_not_their_code():
    """A stage that reads ``rag_eval`` or ``index_corpus`` params checks the configured names against the registries
    (detectors.extensions) without depending on what the entries build; rag_eval,
    which builds them, depends on all of them."""
    for stage in ("pipelines.index_corpus", "pipelines.train_utility"):
        closure = stage_closure(stage)
        assert Path("detectors/extensions.py") in closure
        assert not {Path("detectors/rag/families/flare.py"), Path("detectors/rag/retroactive.py")} & closure, stage
    assert {Path("detectors/rag/families/flare.py"), Path("detectors/rag/retroactive.py")} <= stage_closure(
        "pipelines.rag_eval"
    )
