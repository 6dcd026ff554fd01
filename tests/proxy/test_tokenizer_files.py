"""``--tokenizer`` as a folder or a Hugging Face model id (compose's GPU proxy mounts the HF cache
vLLM downloads into): the id resolves through the cache's refs/main to its snapshot, and an id
whose files are not there yet leaves the proxy on /tokenize until they arrive, then the tokenizer
loads and is checked like one given at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from pd_proxy.backends.pool import BackendPool
from pd_proxy.config import ConfigError, ProxyConfig
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.routing.cache.metrics import CacheMetrics
from pd_proxy.routing.tokenizer import TokenizerFilesError
from pd_proxy.routing.tokenizer_check import TokenizerCheck, tokenizer_check
from pd_proxy.routing.tokenizer_files import hub_cache, tokenizer_folder

MODEL = "deepseek-ai/DeepSeek-V2-Lite-Chat"
REVISION = "85864749cd611b4353ce1decdb286193298f64c7"


def tokenizer_files(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[UNK]"}))
    return folder


def download(hf_home: Path, files: Path) -> Path:
    """The layout huggingface_hub leaves: refs/main names the snapshot holding the files."""
    repo = hf_home / "hub" / ("models--" + MODEL.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(files, snapshot)
    return snapshot


def test_a_folder_is_used_as_it_is(tmp_path: Path) -> None:
    folder = tokenizer_files(tmp_path / "tok")
    assert tokenizer_folder(str(folder), {}) == folder


def test_a_model_id_resolves_to_its_snapshot_in_the_cache(tmp_path: Path) -> None:
    files = tokenizer_files(tmp_path / "files")
    env = {"HF_HOME": str(tmp_path / "hf")}
    assert tokenizer_folder(MODEL, env) is None  # not downloaded yet
    snapshot = download(tmp_path / "hf", files)
    assert tokenizer_folder(MODEL, env) == snapshot
    assert hub_cache({"HF_HUB_CACHE": "/x", "HF_HOME": "/y"}) == Path("/x")


def test_a_path_that_is_no_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match="no such folder"):
        tokenizer_folder(str(tmp_path / "absent"), {})


def check_for(tokenizer: str) -> TokenizerCheck | None:
    url = "http://127.0.0.1:9"  # nothing answers: the /tokenize check retries later
    config = ProxyConfig(
        prefill=(url,), decode=(url,), local_prefill_max_tokens=8, tokenizer=tokenizer
    )
    metrics = CacheMetrics(ProxyMetrics(config.prefill, config.decode).registry)
    return tokenizer_check(config, BackendPool("decode", config.decode), None, metrics)


async def test_a_model_id_not_downloaded_yet_loads_once_its_files_arrive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    check = check_for(MODEL)
    assert check is not None and check.tokenizer is None
    async with aiohttp.ClientSession() as session:
        await check.round(session)
        assert check.tokenizer is None  # still downloading: /tokenize meanwhile
        download(tmp_path / "hf", tokenizer_files(tmp_path / "files"))
        await check.round(session)
    assert check.tokenizer is not None
    assert check.tokenizer.encode("hello world", False) == [1, 2]
    assert not check.validated  # checked against /tokenize before it is trusted
    assert check.trusted == set()


def test_a_missing_folder_stops_the_proxy_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tokenizer \\(PD_PROXY_TOKENIZER\\)"):
        check_for(str(tmp_path / "absent"))
