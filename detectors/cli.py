"""``dynrag``: the command line for what users do with the registered detectors outside DVC.

    dynrag assess "The capital of Occitania is"               # retrieve before answering? (dior-early@champion)
    dynrag monitor "Toulouse is a city in" --title Toulouse   # where dior-realtime would trigger in a generation
    dynrag monitor "Who founded Toulouse?" --model ctrla-confidence
    dynrag promote dior-early 7                               # move the champion alias to version 7
    dynrag relocate                                           # after moving or cloning the project's sqlite store
    dynrag screenshot --dataset realtime                      # the MLflow UI's comparison view as a PNG

Every command takes ``--tracking-uri`` (default: ``$MLFLOW_TRACKING_URI``, else the ``mlflow`` section of ``--params``,
``params.yaml`` in the working directory). Bad input is one line on stderr and exit status 1 (2: a malformed command
line); ``DETECTORS_TRACEBACK=1`` shows the traceback. The library never reads params.yaml: this module does, for the
user.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from detectors.errors import InputError, one_line, traceback_wanted


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``prog: error: ... (see prog --help)``), exit status 2; an argument that is not
    valid UTF-8 text (Python passes its bytes on as surrogates) is one too, before anything loads."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        for position, arg in enumerate(sys.argv[1:] if args is None else args, 1):
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError:
                try:
                    shown = repr(arg.encode("utf-8", "surrogateescape"))  # the bytes as given
                except UnicodeEncodeError:
                    shown = ascii(arg)
                self.error(f"argument {position} ({shown}) is not valid UTF-8 text: pass it encoded in UTF-8")
        return super().parse_known_args(args, namespace)


# ---- values checked where they are parsed (a malformed one: exit status 2, before anything loads) ----------------


def device(value: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N of a CUDA device this machine has."""
    if value in ("auto", "cpu"):
        return value
    match = re.fullmatch(r"cuda(?::(\d+))?", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use auto, cpu, cuda or cuda:N")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise argparse.ArgumentTypeError(f"{value!r}: this machine has no CUDA device: use auto or cpu")
    if match.group(1) is not None and int(match.group(1)) >= count:
        raise argparse.ArgumentTypeError(
            f"{value!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return value


def alias(value: str) -> str:
    """``--alias``: a registered alias as MLflow spells one (letters, digits, '_' and '-', at most 255)."""
    if not re.fullmatch(r"[\w-]{1,255}", value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an alias: use letters, digits, '_' or '-', e.g. champion or challenger"
        )
    return value


def new_alias(value: str) -> str:
    """An alias to set: :func:`alias`, and none of the names MLflow reserves for versions (latest, v1, V2, ...)."""
    if value.lower() == "latest" or re.fullmatch(r"[vV]\d+", value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is reserved by MLflow for versions: choose another alias, e.g. challenger"
        )
    return alias(value)


# ---- the store and the project ----------------------------------------------------------------------


def store(args: argparse.Namespace) -> tuple[str, Path]:
    """The tracking URI a command uses and the project root relative locations (the LLM's directory) are resolved
    against: ``--tracking-uri`` (working directory), else ``--params``, else ``$MLFLOW_TRACKING_URI`` (working
    directory), else ``params.yaml`` of the working directory; its sqlite path is relative to the params file."""
    from detectors.config import load_section
    from detectors.registry.store import tracking_uri

    if args.tracking_uri:
        return tracking_uri(args.tracking_uri, mkdir=False), Path.cwd()
    if args.params is None and os.environ.get("MLFLOW_TRACKING_URI"):
        return tracking_uri(os.environ["MLFLOW_TRACKING_URI"], mkdir=False), Path.cwd()
    params = Path(args.params or "params.yaml").resolve()
    if not params.exists():
        raise InputError(
            f"no MLflow store named and no {params}: pass --tracking-uri URI, set $MLFLOW_TRACKING_URI, or run from "
            f"the "
            "project root (its params.yaml names the store) or pass --params PATH"
        )
    return tracking_uri(load_section("mlflow", params).tracking_uri, params.parent, mkdir=False), params.parent


def detector(args: argparse.Namespace, decides: str, other: str):
    """The detector ``--model``@``--alias``, one that decides retrieval ``decides`` (``Detector.DECIDES``; else an error
    pointing to the ``other`` command), and a function that loads its LLM from the project root on ``--device`` (after
    the caller's own checks: bad input fails fast)."""
    from detectors.inference import load_detector
    from detectors.registry.kinds import kinds_deciding

    uri, root = store(args)
    det = load_detector(args.model, args.alias, tracking_uri=uri, load_llm=False)
    if det.DECIDES != decides:
        kinds = ", ".join(kinds_deciding(decides))
        raise InputError(
            f"{args.model}@{args.alias} is a {det.KIND!r} detector; `{args.command}` takes one of kind {kinds} "
            f"({other})"
        )
    return det, lambda: det.load_llm(device=args.device, root=root)


# ---- commands ---------------------------------------------------------------------------------------


def assess(args: argparse.Namespace) -> None:
    """Each question's decision before generating: retrieve?, the probability, and the keywords to retrieve with."""
    import pandas as pd

    det, load_llm = detector(args, "question", "use `dynrag monitor` for a detector that watches a generation")
    load_llm()
    out = det.predict_frame(pd.DataFrame({"question": args.questions}))
    for question, row in zip(args.questions, out.to_dict("records")):
        keywords = [str(k) for k in row.get("keywords", [])]
        if args.json:
            print(
                json.dumps(
                    {
                        "question": question,
                        "retrieve": bool(row["retrieve"]),
                        "probability": float(row["probability"]),
                        "keywords": keywords,
                    }
                )
            )
        else:
            words = f"  keywords: {', '.join(keywords)}" if keywords else ""
            print(
                f"retrieve: {'yes' if row['retrieve'] else 'no '}  probability: {row['probability']:.3f}{words}  "
                f"question: {question}"
            )


def monitor(args: argparse.Namespace) -> None:
    """Generate a continuation with the detector attached and show where it would trigger retrieval."""
    det, load_llm = detector(args, "generation", "use `dynrag assess` for a detector that decides from the question")
    for name, why in det.WATCH_NEEDS.items():  # asked before the LLM loads
        if not getattr(args, name, None):
            raise InputError(f"{det.KIND} {why}: pass its {name} with --{name} {name.upper()}")
    load_llm()
    needs = {name: getattr(args, name) for name in det.WATCH_NEEDS}
    w = det.watch(args.text, args.max_new_tokens, **needs)
    tokens, scores, trigger, rule, extra = w.tokens, w.scores, w.trigger, w.rule, w.extra
    if args.json:
        print(
            json.dumps(
                {
                    "text": "".join(tokens),
                    "tokens": tokens,
                    "scores": [float(s) for s in scores],
                    "trigger": trigger,
                    **extra,
                }
            )
        )
        return
    marked = (
        "".join(tokens) if trigger is None else "".join(tokens[:trigger]) + " <<retrieve>> " + "".join(tokens[trigger:])
    )
    print(marked)
    if trigger is None:
        print(f"no trigger in {len(tokens)} generated tokens ({rule} never holds)")
    else:
        print(f"trigger at token {trigger} {tokens[trigger]!r}: score {scores[trigger]:.3f} ({rule}): retrieve there")
    for key, value in extra.items():
        print(f"{key}: {value}")


def promote(args: argparse.Namespace) -> None:
    """Move an alias to a version (a person's decision, e.g. for a challenger); prints what moved as JSON."""
    from detectors.registry import store as registry

    registry.configure(store(args)[0], existing=True)
    print(json.dumps(registry.promote(args.name, args.version, args.alias)))


def relocate(args: argparse.Namespace) -> None:
    """Rewrite a moved or cloned sqlite store's artifact locations to where it is now."""
    from detectors.registry.relocate import relocate as relocate_store

    r = relocate_store(store(args)[0], args.from_dir)
    if r["from"] is None:
        print(f"{r['store']} recorded no directory: anchored at {r['to']}")
    elif r["from"] == r["to"]:
        print(f"{r['store']} is in place ({r['to']}): nothing to rewrite")
    else:
        print(f"{r['store']}: {r['rewritten']} artifact locations moved from {r['from']} to {r['to']}")


def screenshot(args: argparse.Namespace) -> None:
    """Screenshot the comparison view of the evaluation runs as the MLflow UI shows it; prints the PNG's path."""
    from detectors.config import load_section
    from detectors.mlflow_ui import screenshot as take
    from detectors.registry.store import configure

    uri, root = store(args)
    configure(uri, existing=True)
    if args.experiment:
        name = args.experiment
    else:
        params = Path(args.params or root / "params.yaml")
        if not params.exists():
            raise InputError(
                f"no {params} to read the experiment prefix (evaluate.experiment) from: pass --experiment NAME or "
                f"--params PATH"
            )
        name = f"{load_section('evaluate', params).experiment}-{args.dataset}"
    out = Path(args.out) if args.out else root / "data" / "screenshots" / f"runs-{args.dataset}.png"
    print(take(uri, name, out, chromium=args.chromium, window_size=args.window_size, wait_ms=args.wait_ms, cwd=root))


# ---- the parser -------------------------------------------------------------------------------------


def parser(prog: str = "dynrag") -> Parser:
    common = Parser(add_help=False)
    common.add_argument(
        "--tracking-uri",
        help="the MLflow store (default: $MLFLOW_TRACKING_URI, else the params file's mlflow.tracking_uri)",
    )
    common.add_argument("--params", help="params file whose mlflow section names the store (default: params.yaml here)")
    model = Parser(add_help=False)
    model.add_argument("--alias", type=alias, default="champion", help="registered alias (default: champion)")
    model.add_argument(
        "--device", type=device, default="auto", help="where the LLM runs: auto, cpu, cuda, cuda:1 (default: auto)"
    )
    model.add_argument("--json", action="store_true", help="one JSON object per result instead of text")

    top = Parser(
        prog=prog, description="Registered retrieval-trigger detectors: assess, monitor, promote, relocate, screenshot."
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "assess",
        parents=[common, model],
        help="retrieve before answering? (an early or utility detector)",
        description=assess.__doc__,
    )
    p.add_argument("questions", nargs="+", metavar="QUESTION")
    p.add_argument("--model", default="dior-early", help="registered name (default: dior-early)")
    p.set_defaults(run=assess)
    p = sub.add_parser(
        "monitor",
        parents=[common, model],
        help="where a generation would trigger retrieval (dior-realtime, ctrla-confidence)",
        description=monitor.__doc__,
    )
    p.add_argument(
        "text", metavar="TEXT", help="dior-realtime: the article's opening to continue; ctrla-confidence: the question"
    )
    p.add_argument("--model", default="dior-realtime", help="registered name (default: dior-realtime)")
    p.add_argument("--title", help="dior-realtime: the article's title (its prompt names it)")
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens to generate (default: 32, ctrla: its artifact's)"
    )
    p.set_defaults(run=monitor)
    p = sub.add_parser(
        "promote", parents=[common], help="move an alias (default: champion) to a version", description=promote.__doc__
    )
    p.add_argument("name")
    p.add_argument("version", type=int)
    p.add_argument("--alias", type=new_alias, default="champion")
    p.set_defaults(run=promote)
    p = sub.add_parser(
        "relocate",
        parents=[common],
        help="rewrite a moved sqlite store's artifact locations",
        description=relocate.__doc__,
    )
    p.add_argument(
        "--from", dest="from_dir", default=None, help="the directory the store was in, for a store that records none"
    )
    p.set_defaults(run=relocate)
    p = sub.add_parser(
        "screenshot", parents=[common], help="PNG of the MLflow UI's comparison view", description=screenshot.__doc__
    )
    p.add_argument("--dataset", default="early", choices=["early", "realtime"])
    p.add_argument("--experiment", help="experiment name (default: <evaluate.experiment of the params file>-<dataset>)")
    p.add_argument("--out", help="PNG path (default: data/screenshots/runs-<dataset>.png in the project)")
    p.add_argument("--chromium", help="Chromium executable (default: chromium on PATH)")
    p.add_argument("--window-size", default="2200,1100")
    p.add_argument("--wait-ms", type=int, default=20000, help="virtual time the page gets to load before the shot")
    p.set_defaults(run=screenshot)
    return top


def main(argv: list[str] | None = None, prog: str = "dynrag") -> int:
    """Run one command; returns the exit status (0; 1: bad input, reported in one line; 2: a malformed command line)."""
    try:
        args = parser(prog).parse_args(argv)
    except SystemExit as done:  # --help (0) or a malformed command line (2), already reported
        return int(done.code or 0)
    try:
        args.run(args)
    except InputError as err:
        if traceback_wanted():
            raise
        print(f"{prog} {args.command}: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
