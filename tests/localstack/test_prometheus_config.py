import re
from pathlib import Path

import yaml

from pcp_pd_kit.localstack.prometheus_config import SCRAPE_JOBS, render_config, write_config
from tests.support.env import example_settings
from tests.support.paths import COMPOSE_DIR


def test_render_scrapes_every_part_on_its_port() -> None:
    config = yaml.safe_load(render_config(example_settings(decode_port=18222), []))
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]
    }
    assert targets == {
        "prefill": ["127.0.0.1:18100"],
        "decode": ["127.0.0.1:18222"],
        "proxy": ["127.0.0.1:18000"],
    }
    assert tuple(targets) == SCRAPE_JOBS
    assert config["global"]["scrape_interval"] == "2s"


def test_alert_rules_loaded_when_present(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    out = tmp_path / "out"
    (repo / "compose" / "prometheus").mkdir(parents=True)
    without = yaml.safe_load(write_config(example_settings(), out, repo).read_text())
    assert without["rule_files"] == []
    alerts = repo / "compose" / "prometheus" / "alerts.yml"
    alerts.write_text("groups: []\n")
    with_rules = yaml.safe_load(write_config(example_settings(), out, repo).read_text())
    assert with_rules["rule_files"] == [str(alerts.resolve())]


def test_jobs_are_the_compose_stacks_so_the_shared_alerts_apply() -> None:
    """alerts.yml selects on the compose job names (PdTargetDown: job=~"prefill|decode|proxy")."""
    compose = COMPOSE_DIR / "prometheus"
    config = yaml.safe_load((compose / "prometheus.yml").read_text())
    assert tuple(job["job_name"] for job in config["scrape_configs"]) == SCRAPE_JOBS
    rules = yaml.safe_load((compose / "alerts.yml").read_text())
    target_down = next(
        rule["expr"]
        for group in rules["groups"]
        for rule in group["rules"]
        if rule.get("alert") == "PdTargetDown"
    )
    selector = re.search(r'job=~"([^"]+)"', target_down)
    assert selector is not None
    assert all(re.fullmatch(selector.group(1), job) for job in SCRAPE_JOBS)
