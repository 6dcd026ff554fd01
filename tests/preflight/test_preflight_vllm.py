"""Prefill and decode on one vLLM release the connector supports: NIXL's handshake (version,
compatibility hash) includes vLLM's version, so a mismatch is a FAIL before `up`, and so is a
release outside ``pcp_nixl_connector.releases`` (the connector would refuse to load); the release
comes from the pulled image's label or VLLM_VERSION, else the tag."""

from __future__ import annotations

from typing import Any

import pytest

from pcp_nixl_connector import releases
from pcp_pd_kit.preflight import vllm_version
from tests.preflight.fake_host import FakeHost, consistent

V32, V33 = "vllm/vllm-openai:v0.32.0", "vllm/vllm-openai:v0.33.0"
V34, V35 = "vllm/vllm-openai:v0.34.0", "vllm/vllm-openai:v0.35.0"


@pytest.mark.parametrize(
    ("image", "tag", "release"),
    [
        (V33, "v0.33.0", "0.33.0"),
        ("registry:5000/vllm/vllm-openai:v0.32.0-cu129", "v0.32.0-cu129", "0.32.0"),
        ("pcp-pd-kit/vllm-cpu:v0.32.0", "v0.32.0", "0.32.0"),
        ("vllm/vllm-openai:0.33.0+cu130@sha256:abc", "0.33.0+cu130", "0.33.0"),
        ("registry:5000/vllm", None, None),
        ("vllm/vllm-openai:latest", "latest", None),
        ("vllm/vllm-openai:nightly-0.33", "nightly-0.33", None),
        ("vllm/vllm-openai:v0.33", "v0.33", None),
    ],
)  # fmt: skip
def test_tags_and_releases(image: str, tag: str | None, release: str | None) -> None:
    assert vllm_version.tag_of(image) == tag
    assert vllm_version.image_release(image, None) == (release, "its tag" if release else "")


@pytest.mark.parametrize(
    ("inspect", "want"),
    [
        ({"Config": {"Labels": {"org.opencontainers.image.version": "v0.33.0"}}},
         ("0.33.0", "its label org.opencontainers.image.version")),
        ({"Config": {"Env": ["PATH=/bin", "VLLM_VERSION=0.32.0"]}}, ("0.32.0", "its VLLM_VERSION")),
        ({"Config": {"Labels": None, "Env": None}}, (None, "")),
        ({}, (None, "")),
    ],
)  # fmt: skip
def test_the_pulled_image_says_it_first(inspect: dict[str, Any], want: tuple) -> None:
    assert vllm_version.from_inspect(inspect) == want
    if want[0]:  # the image's own word beats a tag that says otherwise
        assert vllm_version.image_release("x/y:v9.9.9", inspect) == want


def _images(host: FakeHost, prefill: str, decode: str) -> None:
    host.services["prefill"]["image"] = prefill
    host.services["decode"]["image"] = decode


# (prefill image, decode image, per-image inspect answers, status, needle)
CASES = [
    (V32, V32, {}, "ok", "the same image vllm/vllm-openai:v0.32.0 (vLLM 0.32.0 (its tag))"),
    (V32, V33, {}, "FAIL", "prefill runs vLLM 0.32.0 (vllm/vllm-openai:v0.32.0, its tag) but "
                           "decode runs vLLM 0.33.0"),
    (V33, "mirror/vllm:v0.33.0", {}, "ok", "both run vLLM 0.33.0"),
    (V34, V34, {}, "ok", "the same image vllm/vllm-openai:v0.34.0 (vLLM 0.34.0 (its tag))"),
    (V33, V34, {}, "FAIL", "but decode runs vLLM 0.34.0 (vllm/vllm-openai:v0.34.0, its tag)"),
    (V32, "mine/vllm:dev",
     {"mine/vllm:dev": {"Id": "sha256:2", "Config": {"Env": ["VLLM_VERSION=0.33.0"]}}},
     "FAIL", "decode runs vLLM 0.33.0 (mine/vllm:dev, its VLLM_VERSION)"),
    ("a/vllm:latest", "b/vllm:latest",
     {"a/vllm:latest": {"Id": "sha256:1"}, "b/vllm:latest": {"Id": "sha256:1"}},
     "ok", "are one image"),
    (V32, "mine/vllm:dev", {"mine/vllm:dev": None}, "WARN",
     "the vLLM release of mine/vllm:dev could not be read"),
]  # fmt: skip


@pytest.mark.parametrize(("prefill", "decode", "inspects", "status", "needle"), CASES)
def test_prefill_and_decode_release(
    host: FakeHost, prefill: str, decode: str, inspects: dict, status: str, needle: str
) -> None:
    _images(host, prefill, decode)
    host.images.update(inspects)
    out = consistent(host.run())
    assert out.status("vllm-version") == [status], out.dump()
    assert needle in out.text("vllm-version")
    if status == "FAIL":
        assert "the same image (VLLM_IMAGE in" in out.text("vllm-version")


def test_the_cpu_stack_compares_its_own_services(host: FakeHost) -> None:
    cpu = {"image": "pcp-pd-kit/vllm-cpu:v0.32.0", "profiles": ["cpu"]}
    host.services = {"prefill-cpu": dict(cpu), "decode-cpu": {**cpu, "image": V33}}
    out = consistent(host.run("--profile", "cpu"))
    assert out.status("vllm-version") == ["FAIL"]
    assert "give prefill-cpu and decode-cpu the same image" in out.text("vllm-version")


def test_no_line_without_both_servers(host: FakeHost) -> None:
    del host.services["decode"]
    assert consistent(host.run()).of("vllm-version") == []


@pytest.mark.parametrize("version", [r.version for r in releases.RELEASES])
def test_every_supported_release_passes(host: FakeHost, version: str) -> None:
    image = f"vllm/vllm-openai:v{version}"
    _images(host, image, image)
    out = consistent(host.run())
    assert out.status("vllm-version") == ["ok"], out.dump()


@pytest.mark.parametrize("image", [V35, "vllm/vllm-openai:v0.31.0"])
def test_a_release_the_connector_refuses_is_a_fail(host: FakeHost, image: str) -> None:
    """One line for the image both servers run, naming the supported releases and the fix."""
    _images(host, image, image)
    out = consistent(host.run())
    assert out.status("vllm-version") == ["FAIL"], out.dump()
    text = out.text("vllm-version")
    assert f"prefill and decode run vLLM {vllm_version.release_of(vllm_version.tag_of(image))}" in (
        text
    )
    assert releases.SUPPORTED_TEXT in text and "set VLLM_IMAGE in" in text
    assert f"e.g. vllm/vllm-openai:v{releases.RELEASES[-1].version}" in text


def test_an_unsupported_decode_beside_a_supported_prefill(host: FakeHost) -> None:
    _images(host, V34, V35)
    out = consistent(host.run())
    assert out.status("vllm-version") == ["FAIL", "FAIL"], out.dump()
    assert "decode runs vLLM 0.35.0" in out.text("vllm-version")
    assert "prefill runs vLLM 0.34.0" in out.text("vllm-version")  # and the mismatch


def test_the_connectors_override_makes_it_a_warning(host: FakeHost) -> None:
    _images(host, V35, V35)
    for name in ("prefill", "decode"):
        host.services[name]["environment"] = {"PCP_NIXL_ALLOW_UNSUPPORTED_VLLM": "1"}
    out = consistent(host.run())
    assert out.status("vllm-version") == ["WARN"], out.dump()
    assert "PCP_NIXL_ALLOW_UNSUPPORTED_VLLM=1 lets the connector try it" in out.text("vllm-version")
