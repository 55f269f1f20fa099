"""Shared fixtures: a tiny Llama built in-process, with a byte-level BPE tokenizer trained on the
hand-made QA fixture, and trained for a few seconds to memorise half of the facts (so its answers
are right on those and wrong on the rest, giving both labels).

``DYNRAG_TEST_DEVICE=cuda`` (or ``cuda:N``) runs the tests marked ``gpu`` on that device and deselects the others:
the tiny Llama is trained on the CPU as everywhere, then moved to the device, so results equal the CPU's within the
tests' tolerances; the tiny pipeline's stages load it there and train there (``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from detectors.llm.loading import LLM

ROOT = Path(__file__).resolve().parents[1]
QA_FIXTURE = ROOT / "data" / "fixtures" / "qa_small.jsonl"
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
