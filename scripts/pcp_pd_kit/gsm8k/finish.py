"""After lm-eval: score the run, read the topology, write the manifest, print the verdict."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pcp_pd_kit.gsm8k import EvalError, expected, manifest, results, topology

EXIT_PASS, EXIT_FAIL = 0, 1


def judge(
    out_dir: Path,
    *,
    task: str,
    model: str,
    base_url: str,
    servers: Mapping[str, str],
    run: Mapping[str, Any],
    env: Mapping[str, str],
) -> int:
    """EXIT_PASS or EXIT_FAIL for the lm-eval results under ``out_dir``/lm_eval.

    Writes ``manifest.json`` and ``results.json`` (a copy of lm-eval's) next to them. ``servers``
    maps a role (prefill, decode) to a URL whose self-description goes into the manifest.
    """
    try:
        exp = expected.resolve(model, env)
        results_file = results.find_results_file(out_dir / "lm_eval")
        score, stderr, samples = results.strict_match(results.load(results_file), task)
    except (expected.ExpectationError, results.ResultsError) as exc:
        raise EvalError(str(exc)) from None
    topo = {"proxy": topology.probe_server(base_url)}
    topo.update({role: topology.probe_server(url) for role, url in servers.items()})
    doc = manifest.build(
        run=run,
        score=score,
        stderr=stderr,
        samples=samples,
        expectation=exp,
        topology=topo,
        env=env,
        results_file=str(results_file),
    )
    (out_dir / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    shutil.copyfile(results_file, out_dir / "results.json")
    v = doc["verdict"]
    low, high = v["accepted_range"]
    print(
        f"GSM8K strict-match {score:.4f} on {samples} samples: "
        f"{'PASS' if v['passed'] else 'FAIL'} "
        f"(expected {exp.score} +- {exp.tolerance}, accepted strictly inside "
        f"({low:.4f}, {high:.4f}); settings: {doc['settings']['name']})"
    )
    print(f"results: {out_dir / 'results.json'}  manifest: {out_dir / 'manifest.json'}")
    return EXIT_PASS if v["passed"] else EXIT_FAIL
