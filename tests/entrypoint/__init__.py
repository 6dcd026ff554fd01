"""Tests of the vLLM containers' entrypoint, the package compose/entrypoint/vllm_serve, and of its
neighbours there (keygen, holder, bind_policy). The package is no installed distribution: its
folder goes first on sys.path here, as running the folder does in the containers, so every test
module below imports it as the package it is."""

from __future__ import annotations

import sys

from tests.support.paths import COMPOSE_DIR

ENTRYPOINT_DIR = COMPOSE_DIR / "entrypoint"
if str(ENTRYPOINT_DIR) not in sys.path:
    sys.path.insert(0, str(ENTRYPOINT_DIR))
