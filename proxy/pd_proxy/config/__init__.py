"""Proxy settings: one frozen ``ProxyConfig`` from flags over ``PD_PROXY_*`` variables.

- ``settings``: the dataclass, its defaults and every check that needs no I/O;
- ``values``: the converters and address checks it uses;
- ``flags``: the command line and the environment;
- ``validate``: the one start-up look at the files and the cluster a config names;
- ``textfile``: reading a small settings file whole.
"""

from pd_proxy.config.flags import OPTIONS, build_parser, load_config
from pd_proxy.config.settings import (
    CACHE_ROUTING_MODES,
    ENDPOINTS_FLAG,
    ENV_PREFIX,
    KEY_FILES,
    LOG_LEVELS,
    MAX_WORKERS,
    ROLES,
    ProxyConfig,
    no_backend,
)
from pd_proxy.config.values import ConfigError, split_host_port, split_urls

__all__ = [
    "CACHE_ROUTING_MODES",
    "ENDPOINTS_FLAG",
    "ENV_PREFIX",
    "KEY_FILES",
    "LOG_LEVELS",
    "MAX_WORKERS",
    "OPTIONS",
    "ROLES",
    "ConfigError",
    "ProxyConfig",
    "build_parser",
    "load_config",
    "no_backend",
    "split_host_port",
    "split_urls",
]
