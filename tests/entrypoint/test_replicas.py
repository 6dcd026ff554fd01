"""xPyD on one host: every replica of a role gets the role's whole GPU list and takes its own
slice, TP x PCP x PP ids read from its own vLLM flags, at its replica index (compose's container
number, from a PTR query at Docker's DNS). No GPU needed: these are the ids CUDA is given."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_serve import environment, gpus, replica
from vllm_serve import main as entry

from pd_proxy.testing.dns import PTR, DnsServer
from tests.entrypoint.loader import PACKAGE, main_env

# The flags compose builds from PREFILLER_TP_SIZE=1, PREFILLER_PCP_SIZE=2, DECODER_TP_SIZE=1.
PREFILL_ARGV = ["--model", "m", "--tensor-parallel-size", "1", "--prefill-context-parallel-size=2"]
DECODE_ARGV = ["--model", "m", "--tensor-parallel-size", "1"]
PREFILL = {"KIT_KV_ROLE": "kv_producer", "KIT_ALL_GPUS": "all"}
DECODE = {"KIT_KV_ROLE": "kv_consumer", "KIT_ALL_GPUS": "all"}


def devices(env: dict[str, str], argv: list[str], index: int) -> str:
    """CUDA_VISIBLE_DEVICES of replica ``index`` (its number given, as the DNS would)."""

    def lookup() -> int:
        return index

    out = environment.serve_environment(env, address=lambda: "172.28.0.9", argv=argv, lookup=lookup)
    return out["CUDA_VISIBLE_DEVICES"]


# ------------------------------------------------------------------ GPU semantics
def test_2p2d_on_8_gpus_gives_disjoint_slices() -> None:
    """PREFILL_GPUS=0,1,2,3 DECODE_GPUS=4,5, TP1 PCP2: 2 x 2 + 2 x 1 GPUs, none shared."""
    prefill = {**PREFILL, "KIT_ROLE_GPUS": "0,1,2,3", "KIT_ROLE_REPLICAS": "2"}
    decode = {**DECODE, "KIT_ROLE_GPUS": "4,5", "KIT_ROLE_REPLICAS": "2"}
    got = {
        ("prefill", 1): devices(prefill, PREFILL_ARGV, 1),
        ("prefill", 2): devices(prefill, PREFILL_ARGV, 2),
        ("decode", 1): devices(decode, DECODE_ARGV, 1),
        ("decode", 2): devices(decode, DECODE_ARGV, 2),
    }
    assert got == {
        ("prefill", 1): "0,1",
        ("prefill", 2): "2,3",
        ("decode", 1): "4",
        ("decode", 2): "5",
    }
    ids = [gpu for value in got.values() for gpu in value.split(",")]
    assert sorted(ids) == [str(i) for i in range(6)]  # disjoint, 2x2 + 2x1


def test_1p1d_is_unchanged_and_looks_nothing_up() -> None:
    def never() -> int:
        raise AssertionError("a single replica looked its index up")

    for env in (
        {**PREFILL, "KIT_ROLE_GPUS": "0,1"},
        {**PREFILL, "KIT_ROLE_GPUS": "0,1", "KIT_ROLE_REPLICAS": "1"},
    ):
        out = environment.serve_environment(
            env, address=lambda: "x", argv=PREFILL_ARGV, lookup=never
        )
        assert out["CUDA_VISIBLE_DEVICES"] == "0,1"
    decode = {**DECODE, "KIT_ROLE_GPUS": "2", "KIT_ROLE_REPLICAS": "1"}
    out = environment.serve_environment(decode, address=lambda: "x", argv=DECODE_ARGV, lookup=never)
    assert out["CUDA_VISIBLE_DEVICES"] == "2"


def test_slice_maps_through_a_partial_device_list() -> None:
    """device_ids instead of `count: all`: the slice still becomes in-container indices."""
    env = {**PREFILL, "KIT_ROLE_GPUS": "4,5,6,7", "KIT_ROLE_REPLICAS": "2"}
    env["KIT_ALL_GPUS"] = "4,5,6,7,8"
    assert devices(env, PREFILL_ARGV, 2) == "2,3"


def test_uuids_slice_too() -> None:
    env = {**DECODE, "KIT_ROLE_GPUS": "GPU-a,GPU-b,GPU-c", "KIT_ROLE_REPLICAS": "3"}
    assert [devices(env, DECODE_ARGV, i) for i in (1, 2, 3)] == ["GPU-a", "GPU-b", "GPU-c"]


def test_cpu_servers_get_no_devices_but_know_their_index() -> None:
    env = {"KIT_KV_ROLE": "kv_producer", "KIT_ROLE_REPLICAS": "2"}
    out = environment.serve_environment(env, address=lambda: "x", argv=[], lookup=lambda: 2)
    assert "CUDA_VISIBLE_DEVICES" not in out
    assert replica.placement(env, [], lambda: 2) == (2, 2, [])

    def broken() -> int:
        raise ValueError("no DNS here")

    assert replica.placement(env, [], broken) == (0, 2, [])  # unknown, and no refusal


# ------------------------------------------------------------------ the parallel sizes
@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], 1),
        (["--tensor-parallel-size", "2"], 2),
        (["--tensor-parallel-size=4"], 4),
        (["-tp", "2", "-pcp", "2"], 4),
        (["-tp=2", "--prefill-context-parallel-size=2", "-pp", "2"], 8),
        (["--tensor_parallel_size", "2", "--pipeline-parallel-size=3"], 6),
        # argparse keeps the last value: VLLM_EXTRA_ARGS comes after compose's flags
        (["--tensor-parallel-size", "1", "--max-num-seqs", "8", "--tensor-parallel-size", "2"], 2),
        (["--decode-context-parallel-size", "2", "-tp", "2"], 2),  # DCP runs inside TP
    ],
)
def test_gpus_per_replica_from_argv(argv: list[str], want: int) -> None:
    assert gpus.gpus_per_replica(argv) == want


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size='0'"),
        (["-pcp", "two"], "--prefill-context-parallel-size='two'"),
        (["--tensor-parallel-size"], "has no value"),
        (["--data-parallel-size", "2"], "run more replicas instead"),
    ],
)
def test_bad_parallel_flags_are_refused(argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        gpus.gpus_per_replica(argv)


# ------------------------------------------------------------------ refusals
KNOBS = gpus.ROLE_KNOBS["kv_producer"]


@pytest.mark.parametrize(
    ("ids", "replicas", "per", "index", "needle"),
    [
        (["0", "1", "2"], 2, 2, 1, "PREFILL_GPUS lists 3 GPU\\(s\\) \\(0, 1, 2\\) but PREFILL_REP"),
        (["0", "1"], 2, 2, 1, "= 2 x 2 = 4: list exactly 4 GPU id\\(s\\) in PREFILL_GPUS"),
        (["0", "1", "1", "2"], 2, 2, 1, "PREFILL_GPUS lists GPU 1 more than once"),
        (["0", "1", "2", "3"], 2, 2, 3, "replica index 3 is outside 1..2 \\(PREFILL_REPLICAS=2\\)"),
        (["0", "1", "2", "3"], 2, 2, 0, "replica index 0 is outside"),
    ],
)
def test_replica_gpus_refusals(ids, replicas, per, index, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        gpus.replica_gpus(ids, replicas, per, index, KNOBS)


def test_refusals_reach_the_environment_with_the_knob_names() -> None:
    env = {**DECODE, "KIT_ROLE_GPUS": "4,5,6", "KIT_ROLE_REPLICAS": "2"}
    with pytest.raises(ValueError, match="DECODE_GPUS lists 3 GPU.*DECODE_REPLICAS.*DECODER_TP"):
        devices(env, DECODE_ARGV, 1)
    with pytest.raises(ValueError, match="KIT_ROLE_REPLICAS='0' \\(DECODE_REPLICAS\\)"):
        devices({**env, "KIT_ROLE_REPLICAS": "0"}, DECODE_ARGV, 1)


def test_failed_lookup_with_several_replicas_is_a_refusal() -> None:
    def broken() -> int:
        raise ValueError("reverse DNS of 172.28.0.9 failed (NXDOMAIN)")

    env = {**PREFILL, "KIT_ROLE_GPUS": "0,1,2,3", "KIT_ROLE_REPLICAS": "2"}
    with pytest.raises(ValueError, match="NXDOMAIN.*which of the 2 replicas \\(PREFILL_REPLICAS"):
        environment.serve_environment(env, address=lambda: "x", argv=PREFILL_ARGV, lookup=broken)


def test_index_override_skips_the_lookup() -> None:
    def never() -> int:
        raise AssertionError("looked up although KIT_REPLICA_INDEX was set")

    env = {**PREFILL, "KIT_ROLE_GPUS": "0,1,2,3", "KIT_ROLE_REPLICAS": "2"}
    env["KIT_REPLICA_INDEX"] = "2"
    out = environment.serve_environment(env, address=lambda: "x", argv=PREFILL_ARGV, lookup=never)
    assert out["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ValueError, match="KIT_REPLICA_INDEX='two'"):
        replica.replica_index({"KIT_REPLICA_INDEX": "two"}, 2, never)


# ------------------------------------------------------------------ the replica index from DNS
@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("pcp-pd-kit-prefill-2.pcp-pd-kit_pd.", 2),  # compose v2 on a user-defined network
        ("pcp-pd-kit-decode-1.pcp-pd-kit_pd", 1),
        ("ptrtest-svc-12.ptrtest_pd.", 12),
        ("kit2-prefill-cpu-3.kit2_pd.", 3),  # digits in the project name do not count
        ("pcp-pd-kit_prefill_2.pcp-pd-kit_pd.", 2),  # compose v1 names
        ("3f2a9c1b7d0e.", None),  # a short container id (what /etc/hosts gives)
        ("my-prefill.pcp-pd-kit_pd.", None),  # container_name: no number
        ("", None),
    ],
)
def test_index_from_ptr_answer(name: str, want: int | None) -> None:
    assert replica.index_from_name(name) == want


def test_nameservers_from_resolv_conf() -> None:
    text = "# Generated by Docker Engine.\nsearch lan\nnameserver 127.0.0.11\noptions ndots:0\n"
    assert replica.nameservers(text) == ["127.0.0.11"]
    assert replica.nameservers("nameserver 10.0.0.2\nnameserver   10.0.0.3 \n") == [
        "10.0.0.2",
        "10.0.0.3",
    ]
    assert replica.nameservers("search x\n") == []


class ThreadedDns:
    """pd-proxy's test DNS server on its own event loop thread, for the synchronous lookup."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.server = DnsServer(records)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedDns:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(5)
        return self

    def __exit__(self, *_exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def dns() -> Iterator[ThreadedDns]:
    with ThreadedDns({}) as server:
        yield server


def resolv_conf(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "resolv.conf"
    path.write_text(f"search lan\nnameserver {server}\noptions ndots:0\n")
    return path


def test_lookup_asks_ptr_of_the_own_address(dns: ThreadedDns, tmp_path: Path) -> None:
    """The real lookup code (dnspython) against a DNS server the test controls, answering as
    Docker's embedded DNS does."""
    host, port = dns.server.address
    dns.server.records["9.0.28.172.in-addr.arpa"] = ["pcp-pd-kit-prefill-2.pcp-pd-kit_pd"]
    index = replica.looked_up_index(lambda: "172.28.0.9", resolv_conf(tmp_path, host), port, 2.0)
    assert index == 2
    assert dns.server.queries == [("9.0.28.172.in-addr.arpa", PTR)]


@pytest.mark.parametrize(
    ("answer", "needle"),
    [
        (None, "reverse DNS of this container's address 172.28.0.9 .*NXDOMAIN"),
        (["3f2a9c1b7d0e"], "no single container number"),
        (["kit-prefill-1.kit_pd", "kit-prefill-2.kit_pd"], "no single container number"),
    ],
)
def test_lookup_failures_are_clear(dns: ThreadedDns, tmp_path: Path, answer, needle) -> None:
    host, port = dns.server.address
    if answer is not None:
        dns.server.records["9.0.28.172.in-addr.arpa"] = answer
    with pytest.raises(ValueError, match=needle):
        replica.looked_up_index(lambda: "172.28.0.9", resolv_conf(tmp_path, host), port, 2.0)


def test_lookup_without_an_answer_times_out(dns: ThreadedDns, tmp_path: Path) -> None:
    host, port = dns.server.address
    dns.server.silent.add("9.0.28.172.in-addr.arpa")
    with pytest.raises(ValueError, match="reverse DNS .* failed"):
        replica.looked_up_index(lambda: "172.28.0.9", resolv_conf(tmp_path, host), port, 0.5)


# ------------------------------------------------------------------ the real compose render
def test_compose_render_2p2d_gives_each_replica_its_own_gpus(tmp_path: Path) -> None:
    """compose.yaml as `docker compose config` renders it for 2P2D on 8 GPUs: 2 and 2
    containers, and each container's own environment and command, run through the entrypoint
    at indexes 1..2, give disjoint GPUs covering 2 x 2 + 2 x 1."""
    from tests.compose import checks as cc
    from tests.compose import compose_cli as cli

    overrides = {"PREFILL_REPLICAS": "2", "DECODE_REPLICAS": "2"}
    overrides |= {"PREFILL_GPUS": "0,1,2,3", "DECODE_GPUS": "4,5"}
    model = cli.config(env_file=cli.env_file(tmp_path, overrides))
    placed: dict[str, list[str]] = {}
    for name in ("prefill", "decode"):
        service = model["services"][name]
        assert service.get("scale") == 2, (name, service.get("scale"))
        env, argv = cc.environment(service), cc.command_args(service)
        replicas = gpus.replica_count(env)
        assert replicas == 2, name
        for index in range(1, replicas + 1):
            placed[f"{name}-{index}"] = devices(env, argv, index).split(",")
    assert placed == {
        "prefill-1": ["0", "1"],
        "prefill-2": ["2", "3"],
        "decode-1": ["4"],
        "decode-2": ["5"],
    }
    ids = [gpu for gpus in placed.values() for gpu in gpus]
    assert len(ids) == len(set(ids)) == 2 * 2 + 2 * 1


def test_compose_render_1p1d_is_todays(tmp_path: Path) -> None:
    """.env.example as shipped: one prefill on 0,1 and one decode on 2, nothing looked up."""
    from tests.compose import checks as cc
    from tests.compose import compose_cli as cli

    def never() -> int:
        raise AssertionError("1P1D looked its replica index up")

    model = cli.config()
    got = {}
    for name in ("prefill", "decode"):
        service = model["services"][name]
        env, argv = cc.environment(service), cc.command_args(service)
        out = environment.serve_environment(env, address=lambda: "x", argv=argv, lookup=never)
        got[name] = out["CUDA_VISIBLE_DEVICES"]
    assert got == {"prefill": "0,1", "decode": "2"}


# ------------------------------------------------------------------ as the container runs it
CONNECTOR = {"KIT_KV_CONNECTOR": "PcpCanonicalNixlConnector"}
CONNECTOR |= {"KIT_KV_CONNECTOR_MODULE_PATH": "pcp_nixl_connector"}


def test_start_up_line_names_the_replica_and_its_gpus(monkeypatch, tmp_path, capsys) -> None:
    env = {**CONNECTOR, **PREFILL, "KIT_ROLE_GPUS": "0,1,2,3", "KIT_ROLE_REPLICAS": "2"}
    env |= {"KIT_REPLICA_INDEX": "2", "VLLM_NIXL_SIDE_CHANNEL_HOST": "172.28.0.9"}
    main_env(monkeypatch, tmp_path, env)
    seen = []
    monkeypatch.setattr(entry, "supervise", lambda cmd, env, **kw: seen.append(env) or 0)
    with pytest.raises(SystemExit):
        entry.main(PREFILL_ARGV)
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "2,3"
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("vllm_serve: replica 2 of 2, GPUs 2,3, CUDA_VISIBLE_DEVICES=2,3,")


def test_a_short_list_stops_the_container_with_one_line(tmp_path) -> None:
    env = {**CONNECTOR, **DECODE, "KIT_ROLE_GPUS": "4", "KIT_ROLE_REPLICAS": "2"}
    env |= {"KIT_REPLICA_INDEX": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "172.28.0.9"}
    res = subprocess.run(
        [sys.executable, str(PACKAGE), *DECODE_ARGV],
        env={"PATH": "/usr/bin:/bin", "KIT_CRASH_FILE": str(tmp_path / "c.json"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines() == [
        "vllm_serve: DECODE_GPUS lists 1 GPU(s) (4) but DECODE_REPLICAS x GPUs per replica "
        "(DECODER_TP_SIZE) = 2 x 1 = 2: list exactly 2 GPU id(s) in DECODE_GPUS (replica 1 "
        "takes the first 1, replica 2 the next, ...)"
    ]
