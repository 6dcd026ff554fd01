"""Compose-file helpers the kit's tests and scripts share: .env parsing and ${VAR} interpolation.

Pure functions only (no Docker needed), so the compose files can be checked on a CPU-only CI.
"""

from compose_env.dotenv import parse_dotenv
from compose_env.interpolate import (
    InterpolationError,
    Reference,
    interpolate,
    interpolate_tree,
    references,
    tree_references,
)

__all__ = [
    "InterpolationError",
    "Reference",
    "interpolate",
    "interpolate_tree",
    "parse_dotenv",
    "references",
    "tree_references",
]
