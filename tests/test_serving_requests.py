"""What a request asks of the detectors in a serving engine (``extra_args`` / ``vllm_xargs``) and what it gets back:
parsing, the one-line refusals, and the results aligned with the output's tokens. No vLLM needed (tests/test_vllm.py
runs the plugin in a real engine)."""

from __future__ import annotations

import pytest

from detectors.serving.requests import (
    DetectorRequest,
    ServingRequestError,
    Spec,
    check_kind,
    check_stop,
    scored,
    stop_reason,
    stopped_by_detector,
)


def test_a_request_names_its_detector_and_steering_by_name_and_alias():
    assert DetectorRequest.of(None) is None and DetectorRequest.of({"temperature": 0}) is None
    r = DetectorRequest.of({"detector": "dior-realtime", "stop": "true"})
    assert r == DetectorRequest(Spec("dior-realtime", "champion"), True, None, None)
    r = DetectorRequest.of({"detector": " ctrla-confidence@staging ", "steering": "ctrla-honesty", "lam": "0.5"})
    assert r.detector == Spec("ctrla-confidence", "staging") and str(r.steering) == "ctrla-honesty@champion"
    assert r.lam == 0.5 and not r.stop
    assert r.loads() == [(Spec("ctrla-confidence", "staging"), "detector"), (Spec("ctrla-honesty"), "steering")]
    assert DetectorRequest.of({"detector": "x", "stop": 0}).stop is False  # vllm_xargs carry no booleans: 0 / 1
    # token statistics and a stop at a sentence end need no detector, and load nothing
    r = DetectorRequest.of({"stats": 1, "sentence": "true"})
    assert r.stats and r.sentence and r.stops and r.detector is None and r.loads() == []
    assert not DetectorRequest.of({"detector": "x"}).stops


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"detector": "dior@"}, "detector = 'dior@': name a registered model as 'name' or 'name@alias'"),
        ({"detector": 3}, "detector = 3: name a registered model"),
        ({"steering": "a@b@c"}, "steering = 'a@b@c'"),
        ({"stop": 1}, "stop = 1 needs a 'detector' to stop on"),
        ({"detector": "x", "stop": "maybe"}, "stop = 'maybe': give true or false"),
        ({"detector": "x", "lam": 0.5}, "lam = 0.5 is a steering strength: name a 'steering' direction too"),
        ({"steering": "x", "lam": "strong"}, "lam = 'strong': give a finite number"),
        ({"steering": "x", "lam": float("inf")}, "lam = inf: give a finite number"),
        ({"sentence": "maybe"}, "sentence = 'maybe': give true or false"),
        ({"stats": 0, "sentence": 0}, "name a 'detector' or a 'steering', or set 'stats' or 'sentence'"),
    ],
)
def test_a_bad_request_is_one_line_naming_the_value(args, message):
    with pytest.raises(ServingRequestError) as err:
        DetectorRequest.of(args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_detectors_are_served_by_their_trigger_and_refused_with_what_the_engine_serves():
    check_kind(Spec("dior-realtime"), "dior-realtime", "realtime", "detector")
    check_kind(Spec("ctrla-confidence"), "ctrla-confidence", "ctrla", "detector")
    check_kind(Spec("my-probe"), "my-probe", "realtime", "detector")  # a new kind deciding like DioR's MLP
    check_kind(Spec("ctrla-honesty"), "ctrla-honesty", None, "steering")
    with pytest.raises(
        ServingRequestError,
        match=r"detector = 'dior-early@champion' is a dior-early detector \(trigger early\).*"
        r"whose trigger is realtime or ctrla.*detectors.load_detector",
    ):
        check_kind(Spec("dior-early"), "dior-early", "early", "detector")
    with pytest.raises(ServingRequestError, match="steering = 'ctrla-confidence@champion' is a ctrla-confidence"):
        check_kind(Spec("ctrla-confidence"), "ctrla-confidence", "ctrla", "steering")
    check_stop(DetectorRequest.of({"detector": "d", "stop": 1}), "my-probe", "realtime")
    with pytest.raises(ServingRequestError, match="needs the text's words.*read its scores"):
        check_stop(DetectorRequest.of({"detector": "c", "stop": 1}), "ctrla-confidence", "ctrla")


def test_results_align_with_the_output_tokens():
    request = DetectorRequest.of({"detector": "dior-realtime", "stop": 1})
    info = {"kind": "dior-realtime", "threshold": 0.5, "scores": [0.1, 0.2, 0.7], "stop_token": 9}
    # stopped after the token that reached the threshold: the forced end-of-sequence token has no score
    out = scored(request, info, [4, 5, 6, 9], stop_token=9)
    assert out.scores == [0.1, 0.2, 0.7, None] and out.trigger == 2 and out.stopped
    assert out.detector == "dior-realtime@champion" and out.threshold == 0.5
    # cut at the token budget: the last token never ran, so it has no score; nothing reached the threshold
    out = scored(request, {**info, "scores": [0.1, 0.2]}, [4, 5, 6], stop_token=9)
    assert out.scores == [0.1, 0.2, None] and out.trigger is None and not out.stopped
    # without stop, a token at the threshold is still reported (retrieve there) but the request went on
    out = scored(DetectorRequest.of({"detector": "dior-realtime"}), info, [4, 5, 6, 7], stop_token=9)
    assert out.trigger == 2 and not out.stopped and out.scores == [0.1, 0.2, 0.7, None]
    # CtrlA's scores carry no threshold trigger (its rule reads the words); a steering alone carries no scores
    out = scored(DetectorRequest.of({"detector": "c"}), {"kind": "ctrla-confidence", "scores": [-0.5]}, [4], None)
    assert out.trigger is None and out.scores == [-0.5]
    out = scored(DetectorRequest.of({"steering": "h", "lam": 2}), {"lam": 2.0}, [4, 5], None)
    assert out.scores == [] and out.steering == "h@champion" and out.lam == 2.0


def test_token_statistics_and_the_sentence_end_align_with_the_output_tokens():
    """Each generated token has its probability and entropy but the end-of-sequence token that ended the request;
    ``sentence_end`` holds when the request ended right after a token that ends a sentence."""
    request = DetectorRequest.of({"stats": 1, "sentence": 1})
    info = {"probs": [0.9, 0.5, 0.8, 0.2], "entropies": [0.1, 1.0, 0.4, 2.0], "ends": [False, True, False]}
    out = scored(request, {**info, "ends": [False, True, False]}, [4, 5, 9], stop_token=9)
    assert out.probs == [0.9, 0.5, None] and out.entropies == [0.1, 1.0, None] and out.sentence_end
    assert out.scores == [] and out.detector is None
    # cut at its budget, or ended by a token that ends no sentence: not a sentence end; every token has statistics
    out = scored(request, info, [4, 5, 6], stop_token=9)
    assert out.probs == [0.9, 0.5, 0.8] and not out.sentence_end
    assert not scored(request, {**info, "ends": [False, False, False]}, [4, 5, 9], stop_token=9).sentence_end
    # statistics only for the request that asks for them
    assert scored(DetectorRequest.of({"sentence": 1}), info, [4, 5, 9], stop_token=9).probs == []


def test_the_stop_reason_names_the_detector():
    assert stop_reason(Spec("dior-realtime")) == "detector:dior-realtime@champion"
    assert stopped_by_detector("detector:dior-realtime@champion")
    assert not stopped_by_detector(None) and not stopped_by_detector(2) and not stopped_by_detector("</s>")
