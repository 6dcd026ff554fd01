"""Generate the local Prometheus config: scrape prefill, decode and proxy; load the kit's alerts.

Generated (not committed) because the targets follow the ports in .env, and the compose file's
config names container hosts that do not exist on a bare machine.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pcp_pd_kit.settings import StackSettings

# The compose stack's job names (compose/prometheus/prometheus.yml): the shared alerts in
# compose/prometheus/alerts.yml select on them (PdTargetDown: job=~"prefill|decode|proxy").
SCRAPE_JOBS = ("prefill", "decode", "proxy")


def scrape_targets(settings: StackSettings) -> dict[str, str]:
    """job name -> host:port; one target per job so 'every target up' is unambiguous."""
    return {
        "prefill": f"{settings.host}:{settings.prefill_port}",
        "decode": f"{settings.host}:{settings.decode_port}",
        "proxy": f"{settings.host}:{settings.proxy_port}",
    }


def render_config(
    settings: StackSettings, rule_files: list[Path], proxy_credentials: Path | None = None
) -> str:
    """prometheus.yml text; rule_files are absolute paths (Prometheus resolves them itself).
    ``proxy_credentials``: a file holding the proxy's client key, sent as a bearer token when the
    proxy takes keys (its /metrics is behind them)."""
    interval = f"{settings.prometheus_scrape_interval_s:g}s"
    jobs: list[dict[str, object]] = []
    for job, target in scrape_targets(settings).items():
        scrape: dict[str, object] = {
            "job_name": job,
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [target], "labels": {"stack": "local"}}],
        }
        if job == "proxy" and proxy_credentials is not None:
            scrape["authorization"] = {
                "type": "Bearer",
                "credentials_file": str(proxy_credentials),
            }
        jobs.append(scrape)
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": jobs,
    }
    return yaml.safe_dump(config, sort_keys=False)


def write_config(
    settings: StackSettings, out_dir: Path, repo: Path, proxy_credentials: Path | None = None
) -> Path:
    """Write prometheus.yml under out_dir and return its path; alerts.yml is loaded if present."""
    alerts = repo / "compose" / "prometheus" / "alerts.yml"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "prometheus.yml"
    rules = [alerts.resolve()] if alerts.is_file() else []
    path.write_text(render_config(settings, rules, proxy_credentials))
    return path
