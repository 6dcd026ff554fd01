"""GSM8K through the P/D proxy in one process: ``pcp-pd-kit eval`` (scripts/eval_gsm8k.sh).

cli (flags, env defaults) -> probe (the proxy serves a model) -> expected (the score to reach) ->
offline_task (lm-eval's gsm8k on local files) -> harness (lm-eval in process) -> finish (score,
topology, manifest, verdict). Everything that decides something is a small function tests can call.
"""


class EvalError(Exception):
    """A clear, expected failure: printed as one ``eval_gsm8k: error: ...`` line, exit 2."""
