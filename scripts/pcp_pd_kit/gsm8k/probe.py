"""Is the proxy up, does it let us in, and which model does it serve?"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from pcp_pd_kit.gsm8k import EvalError


def served_model(base_url: str, api_key: str = "", timeout: float = 10.0) -> str:
    """The first model id on ``base_url``/v1/models; EvalError says what to fix otherwise.

    ``api_key`` is the one lm-eval's local-completions will send (both read OPENAI_API_KEY).
    """
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        ) as r:
            body = r.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise EvalError(
                f"the proxy at {base_url} wants an API key: set OPENAI_API_KEY to one of its keys"
                + (" (the one set was refused)" if api_key else "")
            ) from None
        raise EvalError(
            f"the proxy at {base_url} answered {exc.code} on /v1/models: are its backends up?"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise EvalError(
            f"cannot reach the proxy at {base_url} ({reason}). Start the stack "
            "(`docker compose up -d`, `docker compose --profile cpu up -d --wait` or `make demo`) "
            "or point --base-url / EVAL_BASE_URL at it."
        ) from None
    except ValueError as exc:  # urllib's "unknown url type" and friends
        raise EvalError(f"--base-url {base_url!r} is not an http(s) URL ({exc})") from None
    try:
        data = json.loads(body)
    except ValueError:
        raise EvalError(f"{url} did not return JSON: is {base_url} the pd-proxy?") from None
    models = data.get("data") if isinstance(data, dict) else None
    ids = [m.get("id") for m in models or [] if isinstance(m, dict) and m.get("id")]
    if not ids:
        raise EvalError(f"{url} lists no models")
    return str(ids[0])
