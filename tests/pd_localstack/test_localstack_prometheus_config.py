from pathlib import Path

import yaml
from pd_localstack.prometheus_config import SCRAPE_JOBS, render_config, write_config
from pd_localstack.settings import StackSettings


def test_render_scrapes_every_part_on_its_port() -> None:
    config = yaml.safe_load(render_config(StackSettings(decode_port=18222), []))
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]
    }
    assert targets == {
        "vllm-prefill": ["127.0.0.1:18100"],
        "vllm-decode": ["127.0.0.1:18222"],
        "pd-proxy": ["127.0.0.1:18000"],
    }
    assert tuple(targets) == SCRAPE_JOBS
    assert config["global"]["scrape_interval"] == "2s"


def test_alert_rules_loaded_when_present(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    out = tmp_path / "out"
    (repo / "compose" / "prometheus").mkdir(parents=True)
    without = yaml.safe_load(write_config(StackSettings(), out, repo).read_text())
    assert without["rule_files"] == []
    alerts = repo / "compose" / "prometheus" / "alerts.yml"
    alerts.write_text("groups: []\n")
    with_rules = yaml.safe_load(write_config(StackSettings(), out, repo).read_text())
    assert with_rules["rule_files"] == [str(alerts.resolve())]
