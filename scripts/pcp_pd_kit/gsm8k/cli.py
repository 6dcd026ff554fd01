"""The flags of ``pcp-pd-kit eval`` and their environment defaults. Pure: no I/O."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pcp_pd_kit.gsm8k import EvalError
from pd_proxy.timeouts import KIT_NAMES, ProxyLimits, timeout_problems

USAGE = """\
GSM8K accuracy through the P/D proxy: lm-eval `local-completions` against the proxy's
/v1/completions, then a results JSON plus a run manifest (versions, topology read from the
servers, env, score, verdict). Exit 0 = score within the expected band, 1 = outside it,
2 = any error (proxy unreachable, lm-eval failed, no expected score for the model, ...).

Usage: scripts/eval_gsm8k.sh [--base-url URL] [--model NAME] [--limit N] [--num-concurrent N]
         [--num-fewshot N] [--output-dir DIR] [--data-dir DIR] [--prefill-url URL]
         [--decode-url URL] [--max-gen-toks N] [--request-timeout SECONDS]
   (or: pcp-pd-kit eval [same flags])
Env (flags win; defaults in the repo's .env.example, under .env and the environment):
  EVAL_BASE_URL (empty: http://127.0.0.1:$PROXY_PORT), EVAL_MODEL (empty: the model the proxy
  serves), LIMIT, NUM_CONCURRENT, NUM_FEWSHOT, MAX_GEN_TOKS, EVAL_REQUEST_TIMEOUT_S (each
  request's timeout; must exceed the kit proxy's PROXY_* limits), EVAL_OUTPUT_DIR (default
  results/gsm8k-<UTC time>), GSM8K_DATA_DIR (offline: local train.jsonl/test.jsonl),
  EXPECTED_SCORE, SCORE_TOLERANCE, PREFILL_URL / DECODE_URL (empty: http://127.0.0.1:$PREFILL_PORT
  / $DECODE_PORT), OPENAI_API_KEY (the proxy's API key, if it wants one), PYTHON (the wrapper's
  interpreter).
Expected strict-match: DeepSeek-V2-Lite-Chat 0.65 +- 0.05; any other model needs EXPECTED_SCORE."""

# flag -> Settings field; every flag takes one value.
FLAGS = {
    "--base-url": "base_url",
    "--model": "model",
    "--limit": "limit",
    "--num-concurrent": "num_concurrent",
    "--num-fewshot": "num_fewshot",
    "--max-gen-toks": "max_gen_toks",
    "--request-timeout": "request_timeout",
    "--output-dir": "output_dir",
    "--data-dir": "data_dir",
    "--prefill-url": "prefill_url",
    "--decode-url": "decode_url",
}


@dataclass(frozen=True)
class Settings:
    """The run's inputs as given (strings, for the manifest), already validated."""

    base_url: str
    model: str  # "" = the model the proxy serves
    limit: str  # "" = the whole test split
    num_concurrent: str
    num_fewshot: str
    max_gen_toks: str
    request_timeout: str  # seconds, lm-eval's per-request timeout
    output_dir: str  # "" = results/gsm8k-<UTC time>
    data_dir: str  # "" = the Hugging Face hub
    prefill_url: str
    decode_url: str


# Knobs whose defaults .env.example holds (the eval reads the layered env, like the local stack).
REQUIRED_ENV = (
    "NUM_CONCURRENT",
    "NUM_FEWSHOT",
    "MAX_GEN_TOKS",
    "EVAL_REQUEST_TIMEOUT_S",
    "PROXY_PORT",
    "PREFILL_PORT",
    "DECODE_PORT",
)


def env_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """What each setting is without flags; an empty variable counts as unset (like ${X:-d})."""
    missing = [name for name in REQUIRED_ENV if not env.get(name)]
    if missing:
        raise EvalError(
            f"no value for {', '.join(missing)}: .env.example holds the defaults (restore it "
            "from git), or set them in .env or the environment"
        )

    def get(name: str, fallback: str = "") -> str:
        return env.get(name) or fallback

    local = "http://127.0.0.1:{}"
    return {
        "base_url": get("EVAL_BASE_URL", local.format(env["PROXY_PORT"])),
        "model": get("EVAL_MODEL"),
        "limit": get("LIMIT"),
        "num_concurrent": env["NUM_CONCURRENT"],
        "num_fewshot": env["NUM_FEWSHOT"],
        "max_gen_toks": env["MAX_GEN_TOKS"],
        "request_timeout": env["EVAL_REQUEST_TIMEOUT_S"],
        "output_dir": get("EVAL_OUTPUT_DIR"),
        "data_dir": get("GSM8K_DATA_DIR"),
        "prefill_url": get("PREFILL_URL", local.format(env["PREFILL_PORT"])),
        "decode_url": get("DECODE_URL", local.format(env["DECODE_PORT"])),
    }


def _uint(value: str, flag: str, *, positive: bool) -> None:
    if not re.fullmatch(r"[0-9]+", value) or (positive and int(value) == 0):
        kind = "a positive" if positive else "a non-negative"
        raise EvalError(f"{flag} must be {kind} integer, got '{value}'")


def check_request_timeout(timeout: int, env: Mapping[str, str]) -> None:
    """The eval is a client of the kit's pd-proxy: it must wait longer than the proxy's limits
    (PROXY_*_S in the same layered env), or it times out before the proxy's own error arrives."""
    names = ("PROXY_CONNECT_TIMEOUT_S", "PROXY_PREFILL_TIMEOUT_S", "PROXY_DECODE_TIMEOUT_S")
    try:
        connect, prefill, decode = (float(env[name]) for name in names)
    except (KeyError, ValueError):
        return  # the kit's proxy is not configured here: nothing to compare with
    named = {**KIT_NAMES, "client": "--request-timeout/EVAL_REQUEST_TIMEOUT_S"}
    problems = timeout_problems(None, ProxyLimits(connect, prefill, decode), timeout, named)
    if problems:
        raise EvalError(problems[0])


def parse(argv: Sequence[str], env: Mapping[str, str]) -> Settings | None:
    """Settings from flags over env defaults; None for --help. Errors are EvalError."""
    args = list(argv)
    if "-h" in args or "--help" in args:
        return None
    values = env_defaults(env)
    while args:
        arg = args.pop(0)
        flag, has_inline, inline = arg.partition("=")
        if flag not in FLAGS:
            raise EvalError(f"unknown argument '{arg}' (see --help)")
        value = inline if has_inline else (args.pop(0) if args else "")
        if not value:
            raise EvalError(f"{flag} needs a value (see --help)")
        values[FLAGS[flag]] = value
    if values["limit"]:
        _uint(values["limit"], "--limit", positive=True)
    _uint(values["num_concurrent"], "--num-concurrent", positive=True)
    _uint(values["num_fewshot"], "--num-fewshot", positive=False)
    _uint(values["max_gen_toks"], "--max-gen-toks", positive=True)
    _uint(values["request_timeout"], "--request-timeout", positive=True)
    check_request_timeout(int(values["request_timeout"]), env)
    if not re.match(r"https?://[^/]", values["base_url"]):
        raise EvalError(f"--base-url must be an http(s) URL, got '{values['base_url']}'")
    values["base_url"] = values["base_url"].rstrip("/")
    return Settings(**values)
