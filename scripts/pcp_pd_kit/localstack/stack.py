"""The Stack object: start the chosen parts, wait until healthy, expose URLs, stop everything.

Used by `pcp-pd-kit up|demo` and by the e2e tests, so both exercise the same start-up
path. A stack is also a context manager and registers an atexit hook, so an exception or a
Ctrl-C between start() and stop() does not leave vLLM processes behind.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from pcp_pd_kit import repo_root
from pcp_pd_kit.localstack import commands, host, keys, prometheus_config, warmup
from pcp_pd_kit.localstack.host import run_dir
from pcp_pd_kit.localstack.model_source import ResolvedModel, resolve_model, tokenizer_folder
from pcp_pd_kit.localstack.process import (
    ManagedProcess,
    StackProcessError,
    log_tail,
    wait_healthy,
)
from pcp_pd_kit.settings import StackSettings

log = logging.getLogger("pcp_pd_kit.localstack")

T = TypeVar("T")
PD_PARTS = ("prefill", "decode", "proxy", "prometheus")
# With all three, start() sends one request through them before it returns (warmup.py).
WARMED_PARTS = frozenset({"prefill", "decode", "proxy"})
REFERENCE_PARTS = ("reference",)
# Opt-in (the bench): a second pd-proxy with --first-token-from-prefill, on its own port.
FIRST_TOKEN_PROXY = "proxy-first-token"
# Opt-in (the bench): a third pd-proxy with --local-prefill-max-tokens N, on its own port.
LOCAL_PREFILL_PROXY = "proxy-local-prefill"
EXTRA_PROXIES = (FIRST_TOKEN_PROXY, LOCAL_PREFILL_PROXY)


class Stack:
    """A set of named processes (prefill, decode, proxy, prometheus, reference) run together."""

    def __init__(
        self,
        settings: StackSettings,
        parts: Sequence[str] = PD_PARTS,
        repo: Path | None = None,
        work_dir: Path | None = None,
        first_token_proxy_port: int | None = None,
        warm: bool = True,
        local_prefill_proxy_port: int | None = None,
        local_prefill_max_tokens: int = 0,
    ) -> None:
        unknown = set(parts) - set(PD_PARTS) - set(REFERENCE_PARTS) - set(EXTRA_PROXIES)
        if unknown:
            raise ValueError(f"unknown stack parts: {sorted(unknown)}")
        if LOCAL_PREFILL_PROXY in parts and local_prefill_max_tokens < 1:
            raise ValueError(f"{LOCAL_PREFILL_PROXY} needs local_prefill_max_tokens >= 1")
        self.settings = settings
        self.parts = tuple(parts)
        self.repo = repo or repo_root()
        self.work_dir = work_dir or run_dir(self.repo)
        # The first-token proxy's port (default: the proxy's + 1), used only with that part.
        self.first_token_proxy_port = first_token_proxy_port or settings.proxy_port + 1
        # The local-prefill proxy's port (default: the proxy's + 2) and N, used only with it.
        self.local_prefill_proxy_port = local_prefill_proxy_port or settings.proxy_port + 2
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.log_dir = self.work_dir / "logs"
        self.model: ResolvedModel | None = None
        self.processes: dict[str, ManagedProcess] = {}
        # warm=False leaves the first request to the caller (the first-request test's A/B).
        self.warm = warm
        self.warmup: warmup.WarmupResult | None = None
        # The proxy's client key the stack's own requests send (LOCAL_API_KEY_FILE's first).
        self.client_key = keys.client_key(settings.api_key_file)
        self._atexit_registered = False

    # --- URLs -------------------------------------------------------------------------------
    @property
    def urls(self) -> dict[str, str]:
        s = self.settings
        all_urls = {
            "prefill": s.url(s.prefill_port),
            "decode": s.url(s.decode_port),
            "proxy": s.url(s.proxy_port),
            "prometheus": s.url(s.prometheus_port),
            "reference": s.url(s.reference_port),
            FIRST_TOKEN_PROXY: s.url(self.first_token_proxy_port),
            LOCAL_PREFILL_PROXY: s.url(self.local_prefill_proxy_port),
        }
        return {name: url for name, url in all_urls.items() if name in self.parts}

    @property
    def proxy_headers(self) -> dict[str, str]:
        """What a request to the stack's proxy sends besides its body: the client key, if any."""
        return keys.auth_headers(self.client_key)

    @property
    def served_model_name(self) -> str:
        if self.model is None:
            raise RuntimeError("stack not started")
        return self.model.served_name

    # --- lifecycle --------------------------------------------------------------------------
    def ensure_ports_free(self) -> None:
        """Refuse a busy port before any slow step (the demo's model build takes minutes cold)."""
        host.ensure_ports_free(self.settings.host, self._ports())

    def _ports(self) -> dict[str, int]:
        s = self.settings
        wanted: dict[str, int] = {}
        if "reference" in self.parts:
            wanted["reference"] = s.reference_port
        wanted.update(
            {name: port for name, port in s.ports().items() if name.split()[0] in self.parts}
        )
        if FIRST_TOKEN_PROXY in self.parts:
            wanted[FIRST_TOKEN_PROXY] = self.first_token_proxy_port
        if LOCAL_PREFILL_PROXY in self.parts:
            wanted[LOCAL_PREFILL_PROXY] = self.local_prefill_proxy_port
        return wanted

    def _spec(self, part: str, settings: StackSettings | None = None) -> commands.ProcessSpec:
        assert self.model is not None
        s = settings or self.settings
        if part in ("prefill", "decode", "reference"):
            return commands.vllm_server_spec(
                s,
                part,  # type: ignore[arg-type]  # narrowed by the tuple test above
                self.model.path,
                self.model.served_name,
                self.repo,
            )
        tokenizer = tokenizer_folder(self.model.path)
        if part == "proxy":
            return commands.proxy_spec(s, tokenizer=tokenizer)
        if part == FIRST_TOKEN_PROXY:
            return commands.proxy_spec(
                s, first_token_port=self.first_token_proxy_port, tokenizer=tokenizer
            )
        if part == LOCAL_PREFILL_PROXY:
            local = dataclasses.replace(
                s,
                proxy_port=self.local_prefill_proxy_port,
                local_prefill_max_tokens=self.local_prefill_max_tokens,
            )
            spec = commands.proxy_spec(local, tokenizer=tokenizer)
            return dataclasses.replace(spec, name=LOCAL_PREFILL_PROXY)
        if part == "prometheus":
            binary = shutil.which("prometheus")
            if binary is None:
                raise StackProcessError(
                    "prometheus binary not found on PATH (the bootstrap installs it: "
                    "apt-get install prometheus)"
                )
            prom_dir = self.work_dir / "prometheus"
            credentials = None
            if self.client_key is not None:
                credentials = keys.write_credentials(self.client_key, prom_dir / "proxy_key")
            config = prometheus_config.write_config(s, prom_dir, self.repo, credentials)
            data = prom_dir / "data"
            shutil.rmtree(data, ignore_errors=True)  # a fresh TSDB: the report reads this run
            return commands.prometheus_spec(s, config, data, binary)
        raise ValueError(part)

    def start(self) -> Stack:
        """Check ports, resolve the model, start every part, wait until all are healthy, then
        warm the P/D path (one request through proxy, prefill and decode)."""
        self.ensure_ports_free()
        s = self.settings
        self.model = resolve_model(s.model, s.served_model_name, self.repo)
        log.info("model %s served as %r", self.model.path, self.model.served_name)
        if "prefill" in self.parts and s.kv_connector_module_path:
            pkg = self.repo / "connector" / s.kv_connector_module_path.split(".")[0]
            if not pkg.exists():
                raise StackProcessError(
                    f"KV_CONNECTOR_MODULE_PATH={s.kv_connector_module_path}: {pkg} does not exist"
                )
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        try:
            for part in self.parts:
                self.processes[part] = ManagedProcess(self._spec(part), self.log_dir)
                self.processes[part].start()
            wait_healthy(list(self.processes.values()), s.startup_timeout_s)
            if self.warm and WARMED_PARTS <= set(self.parts):
                self._warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _warm_up(self) -> None:
        """The decode's first NIXL handshake and transfer, before anyone else's request."""
        s = self.settings
        # The proxy's own limits end a stalled try (its 504); ours only backs them up.
        timeout_s = 2 * s.proxy_connect_timeout_s + s.proxy_prefill_timeout_s
        timeout_s += s.proxy_decode_timeout_s + 10.0
        send = warmup.proxy_sender(
            self.urls["proxy"],
            self.served_model_name,
            timeout_s,
            s.local_prefill_max_tokens,
            self.proxy_headers,
        )
        try:
            self.warmup = warmup.warm_up(send)
        except warmup.WarmupError as exc:
            tails = "\n".join(
                f"--- {name} ({proc.log_path}):\n{log_tail(proc.log_path, 15)}"
                for name, proc in self.processes.items()
                if name in WARMED_PARTS
            )
            raise StackProcessError(f"{exc}\n{tails}") from exc
        log.info(
            "P/D path warmed: one request through the proxy in %.2fs%s",
            self.warmup.seconds,
            f" after {len(self.warmup.failures)} failed tries" if self.warmup.failures else "",
        )

    def startup_seconds(self) -> dict[str, float]:
        """Seconds from spawn to first healthy answer, per part."""
        return {
            name: proc.healthy_after_s
            for name, proc in self.processes.items()
            if proc.healthy_after_s is not None
        }

    def stop_part(self, part: str) -> None:
        """Terminate one part (its whole process group), e.g. to test the proxy's errors."""
        self.processes[part].stop()

    def start_part(self, part: str, settings: StackSettings | None = None) -> float:
        """(Re)start one part and wait for it; returns its start-up seconds. ``settings`` starts
        it with other knobs (the same ports), e.g. the stock connector for an A/B test."""
        proc = self.processes.get(part)
        if proc is not None and proc.is_running():
            raise RuntimeError(f"{part} is already running")
        host.ensure_ports_free(
            self.settings.host, {k: v for k, v in self._ports().items() if k.split()[0] == part}
        )
        proc = self.processes[part] = ManagedProcess(self._spec(part, settings), self.log_dir)
        proc.start()
        wait_healthy([proc], self.settings.startup_timeout_s)
        assert proc.healthy_after_s is not None
        return proc.healthy_after_s

    def check_alive(self) -> None:
        """Raise naming the first part that died (used by up's watch loop)."""
        for proc in self.processes.values():
            if proc.popen is not None and not proc.is_running():
                raise proc.died_error()

    def stop(self) -> None:
        """Stop every part, proxy first so no request lands on a half-stopped pair."""
        order = [
            LOCAL_PREFILL_PROXY,
            FIRST_TOKEN_PROXY,
            "proxy",
            "prometheus",
            "decode",
            "prefill",
            "reference",
        ]
        for part in sorted(self.processes, key=order.index):
            try:
                self.processes[part].stop()
            except Exception as exc:  # keep stopping the others
                log.error("stopping %s failed: %s", part, exc)
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_until(
    predicate: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 1.0
) -> T:
    """Poll predicate() until it returns a truthy value; log progress; raise TimeoutError."""
    start = time.monotonic()
    last_log = start
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        if now - last_log >= 10:
            last_log = now
            log.info("waiting for %s: %.0fs / %.0fs", what, now - start, timeout_s)
        time.sleep(interval_s)
