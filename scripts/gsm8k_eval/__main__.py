"""``python -m gsm8k_eval <step>``: the steps scripts/eval_gsm8k.sh runs around lm-eval.

Exit codes: 0 ok / eval passed, 1 eval outside tolerance, 2 any error (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

from gsm8k_eval import expected, manifest, offline_task, results, topology

EXIT_FAIL, EXIT_ERROR = 1, 2


def _die(message: str) -> int:
    print(f"eval_gsm8k: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def cmd_probe(args: argparse.Namespace) -> int:
    """Is the proxy up and serving a model? Print the first model id."""
    url = args.url.rstrip("/") + "/v1/models"
    # The same key lm-eval's local-completions sends (it reads OPENAI_API_KEY too).
    key = os.environ.get("OPENAI_API_KEY", "")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return _die(
                f"the proxy at {args.url} wants an API key: set OPENAI_API_KEY to one of its keys"
                + (" (the one set was refused)" if key else "")
            )
        return _die(
            f"the proxy at {args.url} answered {exc.code} on /v1/models: are its backends up?"
        )
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return _die(
            f"cannot reach the proxy at {args.url} ({reason}). Start the stack "
            "(`docker compose up -d`, `docker compose --profile cpu up -d --wait` or `make demo`) "
            "or point --base-url / EVAL_BASE_URL at it."
        )
    except ValueError:
        return _die(f"{url} did not return JSON: is {args.url} the pd-proxy?")
    ids = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    if not ids:
        return _die(f"{url} lists no models")
    print(ids[0])
    return 0


def cmd_expected(args: argparse.Namespace) -> int:
    try:
        exp = expected.resolve(args.model, os.environ)
    except expected.ExpectationError as exc:
        return _die(str(exc))
    print(f"{exp.score} {exp.tolerance} {exp.source.replace(' ', '_')}")
    return 0


def cmd_task(args: argparse.Namespace) -> int:
    try:
        path = offline_task.write_task(Path(args.data_dir), Path(args.out_dir))
    except (OSError, ValueError) as exc:
        return _die(str(exc))
    print(path)
    return 0


def _servers(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        role, sep, url = pair.partition("=")
        if not sep or not url:
            raise ValueError(f"--server wants ROLE=URL, got {pair!r}")
        out[role] = url
    return out


def cmd_finish(args: argparse.Namespace) -> int:
    """Score the run, read the topology, write the manifest, print and return the verdict."""
    out_dir = Path(args.output_dir)
    try:
        exp = expected.resolve(args.model, os.environ)
        results_file = results.find_results_file(out_dir / "lm_eval")
        score, stderr, samples = results.strict_match(results.load(results_file), args.task)
        servers = _servers(args.server)
    except (expected.ExpectationError, results.ResultsError, ValueError) as exc:
        return _die(str(exc))
    topo = {"proxy": topology.probe_server(args.base_url)}
    topo.update({role: topology.probe_server(url) for role, url in servers.items()})
    run = json.loads(args.run_json) if args.run_json else {}
    doc = manifest.build(
        run=run,
        score=score,
        stderr=stderr,
        samples=samples,
        expectation=exp,
        topology=topo,
        env=os.environ,
        results_file=str(results_file),
    )
    (out_dir / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    shutil.copyfile(results_file, out_dir / "results.json")
    v = doc["verdict"]
    word = "PASS" if v["passed"] else "FAIL"
    low, high = v["accepted_range"]
    print(
        f"GSM8K strict-match {score:.4f} on {samples} samples: {word} "
        f"(expected {exp.score} +- {exp.tolerance}, accepted [{low:.4f}, {high:.4f}])"
    )
    print(f"results: {out_dir / 'results.json'}  manifest: {out_dir / 'manifest.json'}")
    return 0 if v["passed"] else EXIT_FAIL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gsm8k_eval", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe", help="check the proxy answers /v1/models; print the model id")
    p.add_argument("--url", required=True)
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("expected", help="print '<score> <tolerance> <source>' for a model")
    p.add_argument("--model", required=True)
    p.set_defaults(func=cmd_expected)
    p = sub.add_parser("task", help="write the offline gsm8k task YAML")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.set_defaults(func=cmd_task)
    p = sub.add_parser("finish", help="score, write manifest.json, exit 0 (pass) or 1 (fail)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--task", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--base-url", required=True)
    p.add_argument("--server", action="append", default=[], metavar="ROLE=URL")
    p.add_argument("--run-json", default="")
    p.set_defaults(func=cmd_finish)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
