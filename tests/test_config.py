"""One settings object: flags over environment over defaults."""
import argparse

import pytest

from proxy.config import OPTIONS, Settings, add_arguments, build_settings


def parse(argv, env):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_settings(parser.parse_args(argv), env)


def test_defaults():
    s = parse([], {})
    assert s.port == 8080 and s.token_spans == "offsets" and s.inject_usage is True


def test_environment_fills_what_flags_leave():
    s = parse(["--port", "9000"], {"LLMPROXY_PORT": "7000", "LLMPROXY_READ_TIMEOUT": "2.5", "LLMPROXY_INJECT_USAGE": "false"})
    assert s.port == 9000 and s.read_timeout == 2.5 and s.inject_usage is False


def test_every_option_has_a_flag_an_env_var_and_a_settings_field():
    fields = set(Settings.__dataclass_fields__)
    for option in OPTIONS:
        assert option.name in fields
        assert getattr(Settings(), option.name) == option.default
        assert option.env == "LLMPROXY_" + option.name.upper()


def test_upstream_key_comes_from_the_named_variable_and_is_not_serialised():
    s = parse(["--upstream-api-key-env", "MY_KEY"], {"MY_KEY": "sk-secret-123"})
    assert s.upstream_api_key == "sk-secret-123"
    assert "sk-secret-123" not in s.to_json() and "sk-secret-123" not in repr(s)
    assert Settings.from_json(s.to_json(), {"MY_KEY": "sk-secret-123"}).upstream_api_key == "sk-secret-123"


def test_bad_values_fail_clearly():
    with pytest.raises(ValueError, match="MISSING"):
        parse(["--upstream-api-key-env", "MISSING"], {})
    with pytest.raises(ValueError, match="http"):
        parse(["--upstream", "ftp://x"], {})
    with pytest.raises(ValueError, match="token-spans"):
        Settings(token_spans="all")


def test_derived_labels():
    assert Settings(upstream="https://api.openai.com/v1").upstream_label == "api.openai.com:443"
    assert Settings(upstream="https://api.openai.com/v1").provider == "openai"
    assert Settings(upstream="http://127.0.0.1:8000/v1").provider == "openai_compatible"
    assert Settings(upstream="http://127.0.0.1:8000/v1").upstream_parts == ("http", "127.0.0.1", 8000, "/v1")
