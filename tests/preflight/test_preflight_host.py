"""The host checks end to end on a fake host: NIXL in the image, PD_SUBNET overlaps, free disk,
the model and its token, secret files, and free host ports."""

from __future__ import annotations

import os
import socket

import pytest

from tests.preflight.fake_host import MODEL, FakeHost, cache_model, consistent

GB = 1000**3


# -- NIXL -----------------------------------------------------------------------------------------
def test_nixl_is_imported_inside_the_pulled_image(host: FakeHost) -> None:
    out = consistent(host.run())
    assert out.status("nixl") == ["ok"]
    run = [c for c in host.calls() if c.startswith("run ")]
    assert len(run) == 1
    assert "--pull never" in run[0] and "--entrypoint python3 vllm/vllm-openai:v0.32.0" in run[0]
    assert run[0].endswith("-c from nixl._api import nixl_agent")


def test_nixl_import_failure(host: FakeHost) -> None:
    host.nixl_rc, host.nixl_output = 1, "ModuleNotFoundError: No module named 'nixl'"
    out = consistent(host.run())
    assert out.status("nixl") == ["FAIL"]
    assert "cannot import NIXL (ModuleNotFoundError: No module named 'nixl')" in out.text("nixl")


def test_absent_image_is_not_pulled(host: FakeHost) -> None:
    host.image = None
    out = consistent(host.run())
    assert out.status("nixl") == ["WARN"]
    assert "is not pulled yet, so NIXL inside it is checked after the pull" in out.text("nixl")
    assert not [c for c in host.calls() if c.startswith(("run ", "pull ", "image pull"))]


# -- subnet ---------------------------------------------------------------------------------------
def test_subnet_overlapping_another_docker_network(host: FakeHost) -> None:
    host.networks.append({"Name": "other_default", "Id": "a" * 64,
                          "Labels": {"com.docker.compose.project": "other"},
                          "IPAM": {"Config": [{"Subnet": "172.28.0.0/16"}]}})  # fmt: skip
    text = consistent(host.run()).text("subnet")
    assert "PD_SUBNET=172.28.0.0/24 overlaps Docker network 'other_default' (172.28.0.0/16)" in text
    assert "set PD_SUBNET in .env to a free range such as 172.16.0.0/24" in text


def test_the_kits_own_network_is_not_an_overlap(host: FakeHost) -> None:
    host.networks.append({"Name": "pcp-pd-kit_pd", "Id": "b" * 64,
                          "Labels": {"com.docker.compose.project": "pcp-pd-kit"},
                          "IPAM": {"Config": [{"Subnet": "172.28.0.0/24"}]}})  # fmt: skip
    assert host.routes is not None
    host.routes.append({"dst": "172.28.0.0/24", "dev": "br-" + "b" * 12})
    assert consistent(host.run()).status("subnet") == ["ok"]


def test_subnet_overlapping_a_host_route(host: FakeHost) -> None:
    assert host.routes is not None
    host.routes.append({"dst": "10.0.0.0/8", "dev": "tun0"})
    host.settings.update(pd_subnet="10.20.0.0/24")
    text = consistent(host.run()).text("subnet")
    assert "overlaps host route on tun0 (10.0.0.0/8)" in text
    assert "such as 172.16.0.0/24" in text


def test_invalid_subnet(host: FakeHost) -> None:
    host.settings.update(pd_subnet="172.28.0.1/24")
    text = consistent(host.run()).text("subnet")
    assert "PD_SUBNET='172.28.0.1/24' is not a network in CIDR form" in text


# -- disk -----------------------------------------------------------------------------------------
def test_nothing_to_download_passes(host: FakeHost) -> None:
    assert consistent(host.run()).text("disk").startswith("nothing to download")


def test_weights_larger_than_the_free_space_fail(host: FakeHost) -> None:
    huge = {"hidden_size": 65536, "num_hidden_layers": 512, "vocab_size": 32000,
            "num_attention_heads": 512, "intermediate_size": 262144}  # fmt: skip
    cache_model(host.cache, "acme/huge", huge)
    host.settings.update(model_name="acme/huge", moe_backend="triton")
    out = consistent(host.run())
    text = out.text("disk")
    assert out.status("disk") == ["FAIL"]
    assert "acme/huge's weights (" in text and "GB not yet cached) need" in text
    assert "free space there or set HF_CACHE_DIR to a bigger disk." in text


def test_image_to_pull_is_counted_against_docker_root(host: FakeHost) -> None:
    host.image = None
    out = consistent(host.run())
    stat = os.statvfs(host.tmp / "docker-root")
    free = stat.f_bavail * stat.f_frsize
    expected = "FAIL" if free < 25 * GB else ("WARN" if free < 30 * GB else "ok")
    assert out.status("disk") == [expected]
    assert "the image vllm/vllm-openai:v0.32.0 (~25 GB, not pulled yet)" in out.text("disk")


def test_partly_cached_weights_count(host: FakeHost, tmp_path) -> None:
    cache = tmp_path / "other-hf"
    cache_model(cache, MODEL, {"torch_dtype": "bfloat16"}, blob_bytes=30 * GB)
    host.settings.update(hf_cache_dir=str(cache))
    text = consistent(host.run()).text("disk")
    assert f"{MODEL}'s weights (1.4 GB not yet cached)" in text  # 31.4 GB in all


def test_invisible_docker_root_is_a_warning(host: FakeHost) -> None:
    host.image = None
    assert host.info is not None
    host.info["DockerRootDir"] = "/nonexistent/docker"
    out = consistent(host.run())
    assert "WARN" in out.status("disk")
    assert "Docker's data root '/nonexistent/docker' is not visible from here" in out.text("disk")


# -- model and token ------------------------------------------------------------------------------
def test_public_model_not_cached_is_downloaded(host: FakeHost, tmp_path) -> None:
    host.settings.update(hf_cache_dir=str(tmp_path / "empty-cache"))
    out = consistent(host.run())
    assert out.status("model") == ["ok"]
    assert "is not cached yet: the servers will download it (~31.4 GB)" in out.text("model")


def test_gated_model_needs_a_token(host: FakeHost) -> None:
    host.settings.update(model_name="meta-llama/Llama-3.1-8B-Instruct")
    out = consistent(host.run())
    assert out.status("model") == ["FAIL"]
    assert "is gated, not in the HF cache" in out.text("model")
    assert f"HF_TOKEN_FILE ({host.token_file}) is missing or empty" in out.text("model")


def test_gated_model_with_a_token_passes_and_the_token_stays_secret(host: FakeHost) -> None:
    host.token_file.write_text("hf_TopSecretValue123\n")
    host.settings.update(model_name="mistralai/Mistral-7B-Instruct-v0.3")
    out = consistent(host.run())
    assert out.status("model") == ["ok"]
    assert "holds a token" in out.text("model")
    text = host.run(json_output=False)
    assert "TopSecret" not in out.stdout + out.stderr + text.stdout + text.stderr


def test_missing_secret_file(host: FakeHost) -> None:
    host.token_file.unlink()
    out = consistent(host.run())
    text = out.text("secrets")
    assert f"mounts secret 'hf_token' from {host.token_file}, which does not exist" in text


# -- ports ----------------------------------------------------------------------------------------
def _listen(address: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen()
    return sock


@pytest.mark.parametrize("key", ["grafana_port", "proxy_port"])
def test_busy_port_is_named(host: FakeHost, key: str) -> None:
    port = int(host.settings[key])
    with _listen("127.0.0.1", port):
        out = consistent(host.run())
    env = key.upper()
    assert out.status("ports") == ["FAIL"]
    assert f"port {port} ({env}) is already in use on" in out.text("ports")
    assert f"ss -ltnp 'sport = :{port}'" in out.text("ports")


def test_port_of_the_kits_own_stack_is_fine(host: FakeHost) -> None:
    port = int(host.settings["grafana_port"])
    host.ps = f"127.0.0.1:{port}->3000/tcp\n"
    with _listen("127.0.0.1", port):
        out = consistent(host.run())
    assert out.status("ports") == ["ok"]
    assert "held by the kit's running stack" in out.text("ports")


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"proxy_port": "70000"}, "PROXY_PORT='70000' is not a TCP port"),
        ({"bind_address": "localhost"}, "BIND_ADDRESS='localhost' is not an IP address"),
        ({"bind_address": "203.0.113.7"}, "BIND_ADDRESS=203.0.113.7 is not an address of this"),
    ],
)  # fmt: skip
def test_bad_port_settings(host: FakeHost, settings: dict[str, str], needle: str) -> None:
    host.settings.update(settings)
    out = consistent(host.run())
    assert needle in out.text("ports")


def test_two_services_on_one_port(host: FakeHost) -> None:
    host.settings.update(grafana_port=host.settings["prometheus_port"])
    text = consistent(host.run()).text("ports")
    assert "PROMETHEUS_PORT and GRAFANA_PORT are both" in text


# -- the secrets folder variant (compose.yaml's secrets_dir instead of hf_token_file) -------------
def _use_secrets_dir(host: FakeHost) -> None:
    folder = host.tmp / "secrets"
    folder.mkdir(exist_ok=True)
    del host.settings["hf_token_file"]
    host.settings["secrets_dir"] = str(folder)
    host.secrets = {"kit_secrets": {"file": str(folder)}}


def test_token_in_the_secrets_folder(host: FakeHost) -> None:
    _use_secrets_dir(host)
    host.settings.update(model_name="meta-llama/Llama-3.1-8B-Instruct")
    out = consistent(host.run())
    assert "the hf_token file in KIT_SECRETS_DIR" in out.text("model")
    assert out.status("model") == ["FAIL"]
    (host.tmp / "secrets" / "hf_token").write_text("hf_abc\n")
    assert consistent(host.run()).status("model") == ["ok"]


def test_missing_secrets_folder(host: FakeHost) -> None:
    _use_secrets_dir(host)
    (host.tmp / "secrets").rmdir()
    text = consistent(host.run()).text("secrets")
    assert f"create it with 'mkdir -m 700 {host.tmp / 'secrets'}'" in text


def test_proxy_bind_address_is_where_the_proxy_port_is_tested(host: FakeHost) -> None:
    host.settings["proxy_bind_address"] = "127.0.0.1"
    port = int(host.settings["proxy_port"])
    out = consistent(host.run())
    assert f"PROXY_PORT {port} on 127.0.0.1" in out.text("ports")
    host.settings["proxy_bind_address"] = "203.0.113.9"
    text = consistent(host.run()).text("ports")
    assert "PROXY_BIND_ADDRESS=203.0.113.9 is not an address of this host" in text
