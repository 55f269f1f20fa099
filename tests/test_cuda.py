"""The GPU paths give the CPU's results. The tiny Llama on the CPU and a copy of it on CUDA (both float32) compute the
early set's records (IG attributions, greedy answers, the answers' hidden states), build_realtime's continuations with
their hidden states, CtrlA's contrast differences and directions, the RAG loop's answers and retrievals; and a
detector trains on the GPU as on the CPU. Skipped where torch sees no CUDA device (``benchmarks/gpu_check.sh`` runs
them on a GPU machine). Tolerances: the two devices' float32 kernels sum in other orders (about 1e-6 relative); the
hidden states are stored in float16 (one rounding step, 1e-3 relative)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import yaml
from conftest import CONTRAST, ROOT, STATEMENTS, TRAINING, qa_rows, synthetic_rows, train

from detectors.config.schema import EarlyFeatureParams, PromptParams
from detectors.ctrla.directions import contrast_differences, fit_pca
from detectors.dior.early import early_records
from detectors.dior.recorder import GenerationRecorder, feature_rows, generate_traced
from detectors.evaluation.metrics import auroc
from detectors.llm.layers import hidden_state_indices
from detectors.llm.loading import LLM
from detectors.rag.corpus import Passage
from detectors.rag.families import make_trigger
from detectors.rag.loop import RagConfig, RagLoop
from detectors.rag.retriever import BM25Retriever

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
FEATURES = EarlyFeatureParams(prompt=PromptParams(template="{question}", chat=False), n_steps=4, hidden_layers=[1, -1])
ROWS = qa_rows()[:12]


@pytest.fixture(scope="module")
def pair(tiny_llm) -> tuple[LLM, LLM]:
    """The tiny Llama on the CPU and on CUDA: the same weights."""
    return tuple(
        LLM.wrap(copy.deepcopy(tiny_llm.model).to(device), tiny_llm.tokenizer, "tiny-llama")
        for device in ("cpu", "cuda")
    )


def test_early_records_on_cuda_equal_the_cpus(pair):
    questions, answers = [r["question"] for r in ROWS], [r["answers"] for r in ROWS]
    indices = hidden_state_indices([1, -1], 2, "answer_hidden_layers")
    cpu, gpu = (early_records(llm, questions, answers, FEATURES, 6, ["\n"], indices) for llm in pair)
    assert len(cpu) == len(gpu) == len(ROWS)
    for a, b in zip(cpu, gpu):
        assert (a["answer"], a["label"], a["answer_ids"], a["keywords"]) == (
            b["answer"],
            b["label"],
            b["answer_ids"],
            b["keywords"],
        )
        np.testing.assert_allclose(a["attribution"], b["attribution"], atol=1e-4)
        assert a["entropy"] == pytest.approx(b["entropy"], abs=1e-4)
        assert a["first_token_prob"] == pytest.approx(b["first_token_prob"], abs=1e-5)
        np.testing.assert_allclose(a["hidden"], b["hidden"], atol=1e-4)
        np.testing.assert_allclose(a["answer_prob"], b["answer_prob"], atol=1e-5)
        np.testing.assert_allclose(a["answer_entropy"], b["answer_entropy"], atol=1e-4)
        if "answer_hidden" in a:
            np.testing.assert_allclose(
                np.asarray(a["answer_hidden"], np.float32),
                np.asarray(b["answer_hidden"], np.float32),
                rtol=2e-3,
                atol=2e-3,
            )


def test_continuations_on_cuda_equal_the_cpus(pair):
    prompts = [f"{r['question']}" for r in ROWS]
    (_, cpu), (_, gpu) = (generate_traced(llm, prompts, [1, 2], max_new_tokens=6, chat=False) for llm in pair)
    for a, b in zip(cpu, gpu):
        assert a.gen_ids == b.gen_ids
        np.testing.assert_allclose(a.prob, b.prob, atol=1e-5)
        np.testing.assert_allclose(a.entropy, b.entropy, atol=1e-4)
        np.testing.assert_allclose(a.hidden.astype(np.float32), b.hidden.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_the_recorder_scores_on_the_llms_device_wherever_the_prompt_is(pair):
    """model.generate gives the logits processors the logits on the prompt's device: a prompt on the host with the LLM
    on the GPU is recorded and scored as one on the GPU (the features of every token on one device)."""
    _, gpu = pair
    traces = []
    for device in ("cpu", "cuda"):
        enc = gpu.tokenizer(ROWS[0]["question"], return_tensors="pt").to(device)
        recorder = GenerationRecorder(gpu.model, [1, 2], scorer=lambda h, p, e: feature_rows(h, p, e).sum(1))
        with torch.no_grad(), recorder:
            gpu.model.generate(**enc, logits_processor=[recorder], max_new_tokens=5, do_sample=False)
        traces.append(recorder.traces(set())[0])
    host, device = traces
    assert host.gen_ids == device.gen_ids and len(host.gen_ids) > 0
    np.testing.assert_allclose(host.scores, device.scores, rtol=1e-6)
    np.testing.assert_allclose(host.prob, device.prob, rtol=1e-6)


def test_ctrla_directions_on_cuda_equal_the_cpus(pair):
    stats = [contrast_differences(llm, CONTRAST, STATEMENTS, batch_size=4) for llm in pair]
    np.testing.assert_allclose(stats[0].diffs.cpu().numpy(), stats[1].diffs.cpu().numpy(), atol=1e-4)
    (v_cpu, e_cpu), (v_gpu, e_gpu) = (fit_pca(s.diffs, seed=0) for s in stats)
    cosine = (v_cpu.cpu().double() * v_gpu.cpu().double()).sum(-1)
    assert float(cosine.min()) > 0.9999  # same directions, same orientation
    np.testing.assert_allclose(e_cpu.cpu().numpy(), e_gpu.cpu().numpy(), atol=1e-5)


def test_rag_loop_on_cuda_answers_and_retrieves_as_on_the_cpu(pair):
    passages = [Passage(f"p{i}", r["question"], f"{r['question']} {r['answers'][0]}.") for i, r in enumerate(ROWS)]
    retriever = BM25Retriever.build(passages, PARAMS["index_corpus"]["bm25"])
    questions = [r["question"] for r in ROWS]
    prompt = PromptParams(template="{question}", chat=False)
    results = []
    for llm in pair:
        trigger = make_trigger("rind", llm, None, PARAMS["build_realtime"]["spacy_model"])
        config = RagConfig("rind", prompt, max_retrievals=2, max_new_tokens=6, batch_size=6)
        traces = RagLoop(llm, retriever, config, [trigger]).trace(questions)
        scores = np.concatenate([t.token_scores["rind"] for t in traces])
        trigger.threshold = float(np.median(scores[scores > 0]))  # RIND is 0 on stop words and punctuation
        results.append((trigger.threshold, RagLoop(llm, retriever, config, [trigger]).answer_all(questions)))
    (t_cpu, cpu), (t_gpu, gpu) = results
    assert t_cpu == pytest.approx(t_gpu, rel=1e-4)
    assert any(r.retrievals for r in cpu)  # the loop retrieved, so its retrieval path ran on both devices
    for a, b in zip(cpu, gpu):
        assert a.answer == b.answer and a.forward_passes == b.forward_passes
        assert [(x.position, x.queries, x.passage_ids) for x in a.retrievals] == [
            (x.position, x.queries, x.passage_ids) for x in b.retrievals
        ]


def test_a_detector_trains_on_the_gpu_as_on_the_cpu():
    frame = synthetic_rows(240)
    test = frame[frame["split"] == "test"].to_dict("records")
    cpu, gpu = (train(frame, ["attribution"], dataclasses.replace(TRAINING, accelerator=a)) for a in ("cpu", "gpu"))
    assert cpu.info["device"] == "cpu" and gpu.info["device"].startswith("cuda")
    p_cpu, p_gpu = cpu.predict_proba(test), gpu.predict_proba(test)
    labels = [r["label"] for r in test]
    assert auroc(labels, p_gpu) > 0.85
    assert auroc(labels, p_gpu) == pytest.approx(auroc(labels, p_cpu), abs=0.02)
