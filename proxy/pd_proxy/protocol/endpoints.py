"""The paths the proxy serves and forwards, as one ``Endpoint`` type mypy checks."""

from __future__ import annotations

from typing import Final, Literal

# The two completions endpoints a client calls; the legs forward to the same path.
Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
COMPLETIONS: Final = "/v1/completions"
CHAT_COMPLETIONS: Final = "/v1/chat/completions"
ENDPOINTS: tuple[Endpoint, ...] = (COMPLETIONS, CHAT_COMPLETIONS)
JSON_TYPE = "application/json"

# The field each endpoint cannot do without.
REQUIRED_FIELD: dict[str, str] = {COMPLETIONS: "prompt", CHAT_COMPLETIONS: "messages"}
