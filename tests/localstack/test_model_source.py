from pathlib import Path

import pytest

from pcp_pd_kit.localstack.model_source import (
    ModelNotAvailableError,
    resolve_model,
    tokenizer_folder,
)


def _never_build(path: Path) -> Path:
    raise AssertionError("must not build the tiny model")


def test_empty_model_builds_tiny_under_repo(tmp_path: Path) -> None:
    built: list[Path] = []

    def build(path: Path) -> Path:
        built.append(path)
        return path

    resolved = resolve_model("", "", tmp_path, build_tiny=build)
    assert built == [tmp_path / ".models" / "tiny-mla-moe"]
    assert resolved.served_name == "tiny-mla-moe" and resolved.built_tiny


def test_local_directory_needs_config(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    with pytest.raises(ModelNotAvailableError, match="has no config.json"):
        resolve_model(str(model), "", tmp_path, build_tiny=_never_build)
    (model / "config.json").write_text("{}")
    resolved = resolve_model(str(model), "", tmp_path, build_tiny=_never_build)
    assert (resolved.path, resolved.served_name) == (str(model), "my-model")


def test_uncached_hf_id_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailableError, match="not in the local Hugging Face cache"):
        resolve_model("org/model", "", tmp_path, build_tiny=_never_build, is_cached=lambda m: False)


def test_cached_hf_id_is_used_as_is(tmp_path: Path) -> None:
    resolved = resolve_model(
        "org/model", "alias", tmp_path, build_tiny=_never_build, is_cached=lambda m: True
    )
    assert (resolved.path, resolved.served_name) == ("org/model", "alias")


def test_nonsense_model_value(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailableError, match="no such directory"):
        resolve_model("no/such/thing/here", "", tmp_path, build_tiny=_never_build)


def test_a_server_side_path_is_not_an_hf_id() -> None:
    """The remote bench asks about the served model's root, which for the compose cpu profile is
    a path inside the container: no repo id, so not cached (huggingface_hub would raise)."""
    from pcp_pd_kit.localstack.model_source import hf_cached

    assert hf_cached("/models/tiny-mla-moe") is False
    assert hf_cached("no-such-org/no-such-model-for-the-kit") is False


def test_tokenizer_folder_of_a_directory_or_a_cached_id(tmp_path: Path) -> None:
    """pd-proxy's --tokenizer: the folder with tokenizer.json, or None (it asks /tokenize)."""
    model = tmp_path / "m"
    model.mkdir()
    assert tokenizer_folder(str(model)) is None
    (model / "tokenizer.json").write_text("{}")
    assert tokenizer_folder(str(model)) == str(model)
    snapshot = tmp_path / "hub" / "snap"
    cached = {("org/name", "tokenizer.json"): str(snapshot / "tokenizer.json")}
    assert tokenizer_folder("org/name", lambda i, f: cached.get((i, f))) == str(snapshot)
    assert tokenizer_folder("org/other", lambda i, f: cached.get((i, f))) is None
