"""TruthfulQA multiple choice (MC1) under CtrlA's honesty steering (CtrlA Fig. 2): the BIG-bench task's examples
(:func:`load_truthfulqa`), the accuracy at one steering (:func:`mc_accuracy`) and at each strength
(:func:`truthfulqa_grid`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from detectors.ctrla.directions import Directions
from detectors.ctrla.steering import steer, steering_vectors
from detectors.llm.kv import as_cache, cache_kv, prefix_cache
from detectors.llm.loading import LLM
from detectors.progress import progress as progress_bar  # (mc_accuracy has a flag named progress)
from detectors.sources.bigbench import fetch_bigbench_task

log = logging.getLogger(__name__)


def load_truthfulqa(
    raw_dir: str | Path,
    task: str = "truthful_qa",
    file: str = "task_mc.json",
    limit: int | None = None,
    few_shot: bool = True,
) -> tuple[str, list[dict[str, Any]]]:
    """The few-shot prefix (empty unless ``few_shot``) and a deterministic subset of ``limit`` MC examples."""
    examples = fetch_bigbench_task(task, raw_dir, file)
    spec = json.loads((Path(raw_dir) / "bigbench" / task / file).read_text())
    usable = [
        e
        for e in examples
        if e.get("input") and sum(e.get("target_scores", {}).values()) == 1 and len(e["target_scores"]) > 1
    ]
    if not usable:
        raise ValueError(f"{task}/{file} holds no multiple-choice example with exactly one correct answer")
    subset = usable if limit is None else usable[:: max(1, len(usable) // limit)][:limit]
    return (spec.get("task_prefix", "") if few_shot else ""), subset


def mc_accuracy(
    llm: LLM,
    prefix_text: str,
    examples: list[dict[str, Any]],
    vectors: dict[int, torch.Tensor],
    progress: bool = True,
    batch_size: int = 8,
) -> tuple[float, np.ndarray]:
    """MC1 accuracy: the candidate with the highest summed log-likelihood must be the correct one.

    The whole prompt, few-shot prefix included, runs under the steering ``vectors`` (none for λ = 0). The
    prefix runs once; ``batch_size`` questions run together on its cache (right-padded), then all their
    candidates together, each on its own question's cache rows (the question's padding masked out). On a
    2-core CPU 8 questions per pass take 0.18 s/question against 0.22 one at a time (and 32, 0.22).
    """
    prefix = llm.tokenizer(prefix_text)["input_ids"] if prefix_text else []
    head, decoder = llm.model.get_output_embeddings(), llm.model.get_decoder()
    pad, dev = llm.tokenizer.pad_token_id or 0, llm.device
    hits = []
    with (
        steer(llm.model, vectors),
        torch.no_grad(),
        progress_bar(total=len(examples), desc="TruthfulQA", unit="q", disable=not progress) as bar,
    ):
        kv = prefix_cache(llm, prefix)
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            questions = [
                llm.tokenizer(f"\nQ: {ex['input']}\nA:", add_special_tokens=False)["input_ids"] for ex in batch
            ]
            width = max(len(q) for q in questions)
            ids = torch.tensor([q + [pad] * (width - len(q)) for q in questions], device=dev)
            out = decoder(ids, past_key_values=as_cache(kv, len(batch), llm.model.config), use_cache=True)
            last_q = out.last_hidden_state[torch.arange(len(batch)), torch.tensor([len(q) - 1 for q in questions])]
            owner, answers = zip(
                *[
                    (b, llm.tokenizer(f" {a}", add_special_tokens=False)["input_ids"])
                    for b, ex in enumerate(batch)
                    for a in ex["target_scores"]
                ]
            )
            rows = torch.tensor(owner, device=dev)
            cache = DynamicCache(
                ddp_cache_data=[(k[rows], v[rows]) for k, v in cache_kv(out.past_key_values)],
                config=llm.model.config,
            )
            seen = torch.zeros(len(rows), len(prefix) + width, dtype=torch.long, device=dev)
            for r, b in enumerate(owner):
                seen[r, : len(prefix) + len(questions[b])] = 1
            a_width = max(len(a) for a in answers)
            a_ids = torch.tensor([a + [pad] * (a_width - len(a)) for a in answers], device=dev)
            positions = torch.tensor(
                [[len(prefix) + len(questions[b]) + j for j in range(a_width)] for b in owner], device=dev
            )
            mask = torch.cat([seen, torch.ones(len(rows), a_width, dtype=torch.long, device=dev)], dim=1)
            hidden = decoder(
                a_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
            ).last_hidden_state
            loglik = [[] for _ in batch]
            for r, (b, a) in enumerate(zip(owner, answers)):
                states = torch.cat([last_q[b : b + 1], hidden[r, : len(a) - 1]])  # the state before each answer token
                logp = torch.log_softmax(head(states).float(), dim=-1)
                loglik[b].append(float(logp.gather(1, torch.tensor(a, device=dev)[:, None]).sum()))
            hits.extend(bool(list(ex["target_scores"].values())[int(np.argmax(ll))]) for ex, ll in zip(batch, loglik))
            bar.update(len(batch))
    hits_arr = np.array(hits)
    return float(hits_arr.mean()), hits_arr


def truthfulqa_grid(
    llm: LLM, honesty: Directions, prefix: str, examples: list, lambdas: list[float], relative: bool
) -> dict[str, float]:
    """TruthfulQA MC1 accuracy at each steering strength λ (CtrlA Fig. 2; 0: no steering)."""
    accuracy = {}
    for lam in lambdas:
        vectors = steering_vectors(honesty, lam, honesty.layers, relative) if lam else {}
        accuracy[str(lam)], _ = mc_accuracy(llm, prefix, examples, vectors)
        log.info("TruthfulQA MC1, λ = %g: %.3f", lam, accuracy[str(lam)])
    return accuracy
