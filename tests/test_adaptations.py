"""The paper's (or released code's) choices that benchmarks.adaptations measures beside the configured ones: each
computes what its docstring says, on small inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.adaptations import ReleasedQfsQuery, TvqQuery, released_scale
from detectors.baselines.rind import later_attention_max, rind_on_kv, rind_trace
from detectors.ctrla.monitor import running_scores
from detectors.llm.kv import crop_kv, prefix_cache
from detectors.llm.layers import attention_implementation
from detectors.llm.words import DEFAULT_STOPWORDS
from detectors.rag.queries import QueryInput, qfs_query
from detectors.rag.stats import SegmentView

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)


def test_the_released_scale_is_not_centred_so_the_sign_of_the_projection_decides():
    x = np.array([4.0, 2.0, 3.0, 1.0, 2.5, 1.5, 3.5, 0.5, 2.0])  # every projection above tau = 0: all confident
    released = released_scale(x, tau=0.0)
    assert np.all(released == released.max())  # every token at the bound: nothing ever scores unconfident
    centred = running_scores(torch.tensor(x)[None], tau=0.0).numpy()[0]
    assert (centred < 0).any()  # the paper's running z-score calls the below-average tokens unconfident

    y = x - 2.2  # now some below tau
    scaled = released_scale(y, tau=0.0)
    assert np.array_equal(scaled < 0, y < 0)  # the raw sign decides
    below = np.flatnonzero(y < 0)
    assert scaled[below[np.argmin(y[below])]] == scaled.min()  # the unconfident tokens keep their order


def test_an_outlier_projection_is_replaced_by_the_median_before_scaling():
    x = np.r_[np.linspace(-1.0, 1.0, 40), [-500.0]]
    assert released_scale(x, tau=0.0)[-1] == released_scale(np.r_[x[:-1], [np.median(x)]], tau=0.0)[-1]


def test_rind_of_the_segment_alone_reads_the_attention_of_a_pass_over_the_segment_only(tiny_llm):
    context, segment = (
        tiny_llm.tokenizer("Paris is the capital of")["input_ids"],
        tiny_llm.tokenizer(" France and Berlin")["input_ids"],
    )
    entropy = np.linspace(0.5, 2.0, len(segment))
    states = prefix_cache(tiny_llm, context)
    alone = rind_on_kv(tiny_llm, [crop_kv(states, 0)], [segment], [entropy], DEFAULT_STOPWORDS)[0]
    with torch.no_grad(), attention_implementation(tiny_llm.model, "eager"):
        weights = tiny_llm.model(torch.tensor([segment], device=tiny_llm.device), output_attentions=True).attentions[-1]
    expected = rind_trace(
        tiny_llm,
        segment,
        entropy,
        later_attention_max(weights, torch.tensor([len(segment)]))[0].cpu().numpy(),
        DEFAULT_STOPWORDS,
    )
    np.testing.assert_allclose(alone.rind, expected.rind, rtol=1e-5, atol=1e-7)
    within = rind_on_kv(tiny_llm, [states], [segment], [entropy], DEFAULT_STOPWORDS)[0]
    assert not np.allclose(within.rind, alone.rind)  # the configured window (prompt + segment) is another score


def test_the_targeted_validation_query_follows_the_question_and_is_the_question_before_any_answer(tiny_llm):
    tvq = TvqQuery(chat=False, tokens=6)
    ids = tiny_llm.tokenizer(" Berlin")["input_ids"]
    view = SegmentView("The capital of France is", [], ids, " Berlin", {}, {}, {})
    queries = tvq.formulate_all(
        tiny_llm,
        [
            QueryInput("The capital of France is", [], None, 0, {}),
            QueryInput("The capital of France is", [], view, 0, {}),
        ],
    )
    assert queries[0] == "The capital of France is"
    assert queries[1].startswith("The capital of France is")


def test_the_released_qfs_reads_the_attention_row_of_the_token_before_the_flagged_one(tiny_llm):
    question = "The capital of France is"
    ids = tiny_llm.tokenizer(" Berlin and Paris are cities")["input_ids"]
    view = SegmentView(question, [], ids, " Berlin and Paris are cities", {}, {}, {})
    flagged = len(ids) - 1
    (query,) = ReleasedQfsQuery().formulate_all(tiny_llm, [QueryInput(question, [], view, flagged, {})])
    context = tiny_llm.tokenizer(question, add_special_tokens=False)["input_ids"] + ids
    assert query == qfs_query(tiny_llm, context[:-1], len(context) - 2, 25)  # row i-1 over the tokens before it
