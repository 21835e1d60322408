"""forge's settings: each refuses a value it does not know, naming the ones it takes, and
each can be set from the environment as FORGE_<NAME>."""

import importlib

import pytest

from forge_compile.config import ForgeConfig

# forge_compile.config is the settings object; its module is reached by name.
config_module = importlib.import_module("forge_compile.config")


@pytest.mark.parametrize("name,good,bad", [
    ("kernel", "torch", "cuda"),
    ("linear_update_path", "chunked", "tiled"),
    ("warp_specialize", "never", "yes"),
])  # fmt: skip
def test_a_choice_takes_its_values_and_refuses_others(name, good, bad):
    settings = ForgeConfig()
    setattr(settings, name, good)
    assert getattr(settings, name) == good
    with pytest.raises(ValueError, match=f"config.{name} must be one of .*{good}"):
        setattr(settings, name, bad)


def test_an_unknown_setting_is_refused_with_the_known_ones():
    with pytest.raises(AttributeError, match="unknown setting 'warp_specialise'.*'warp_specialize'"):
        ForgeConfig().warp_specialise = "always"


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("FORGE_WARP_SPECIALIZE", "always")
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    settings = config_module._from_environment()
    assert settings.warp_specialize == "always" and settings.autotune is False


def test_a_bad_value_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("FORGE_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="FORGE_AUTOTUNE='sometimes' is not a boolean"):
        config_module._from_environment()
    monkeypatch.setenv("FORGE_AUTOTUNE", "1")
    monkeypatch.setenv("FORGE_WARP_SPECIALIZE", "on")
    with pytest.raises(ValueError, match="config.warp_specialize must be one of"):
        config_module._from_environment()


def test_the_head_chunk_size_is_a_whole_number_from_code_or_the_environment(monkeypatch):
    settings = ForgeConfig()
    settings.head_chunk_columns = 4096
    with pytest.raises(ValueError, match="head_chunk_columns must be a whole number of columns"):
        settings.head_chunk_columns = -1
    monkeypatch.setenv("FORGE_HEAD_CHUNK_COLUMNS", "2048")
    assert config_module._from_environment().head_chunk_columns == 2048
    monkeypatch.setenv("FORGE_HEAD_CHUNK_COLUMNS", "2k")
    with pytest.raises(ValueError, match="FORGE_HEAD_CHUNK_COLUMNS='2k' is not a whole number"):
        config_module._from_environment()
