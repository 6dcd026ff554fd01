"""Compose-style .env parsing, shared by the local stack (pd_localstack) and the compose tests.

Pure functions only: the compose file itself is rendered by the real `docker compose config`.
"""

from compose_env.dotenv import parse_dotenv

__all__ = ["parse_dotenv"]
