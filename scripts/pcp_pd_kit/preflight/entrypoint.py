"""The vLLM servers' own rules, imported from their entrypoint package (compose/entrypoint/
vllm_serve): each replica's GPUs, the ENFORCE_EAGER switch and the UCX settings that leave the KV
pull to TCP, so preflight refuses exactly what the containers would refuse.

The package is not installed for a host's system python3; its folder is put on sys.path here, as
check_vllm does for the connector's release list. The modules imported below use only the
standard library, in Python 3.8 syntax (tests/preflight checks both)."""

from __future__ import annotations

import sys

from pcp_pd_kit import repo_root

_ENTRYPOINT_DIR = str(repo_root() / "compose" / "entrypoint")
if _ENTRYPOINT_DIR not in sys.path:
    sys.path.append(_ENTRYPOINT_DIR)
from vllm_serve.gpus import ROLE_KNOBS, gpus_per_replica, replica_gpus  # noqa: E402
from vllm_serve.switches import EAGER_ENV, enforce_eager  # noqa: E402
from vllm_serve.transport import transport_warnings  # noqa: E402

__all__ = [
    "EAGER_ENV",
    "ROLE_KNOBS",
    "enforce_eager",
    "gpus_per_replica",
    "replica_gpus",
    "transport_warnings",
]
