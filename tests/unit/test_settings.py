"""Service settings from MPFLOW_* environment variables."""

import pydantic
import pytest
from mpflow.service.settings import Settings, parse_api_keys


def test_defaults_and_environment_overrides(monkeypatch):
    for var in ("MPFLOW_REDIS_URL", "MPFLOW_API_KEYS", "MPFLOW_MAX_PARTICLES", "MPFLOW_BATCH_MAX_WAIT_MS"):
        monkeypatch.delenv(var, raising=False)
    s = Settings()
    assert s.redis_url is None and s.max_particles == 65536 and s.max_body_bytes == 8 * 1024 * 1024
    monkeypatch.setenv("MPFLOW_REDIS_URL", "redis://127.0.0.1:6379/3")
    monkeypatch.setenv("MPFLOW_MAX_PARTICLES", "1024")
    monkeypatch.setenv("MPFLOW_BATCH_MAX_WAIT_MS", "0.5")
    s = Settings()
    assert s.redis_url == "redis://127.0.0.1:6379/3" and s.max_particles == 1024 and s.batch_max_wait_ms == 0.5
    monkeypatch.setenv("MPFLOW_REDIS_URL", "")
    assert Settings().redis_url is None  # empty means "use the embedded store"


def test_non_positive_limits_are_refused_naming_the_field(monkeypatch):
    monkeypatch.setenv("MPFLOW_MAX_PARTICLES", "0")
    with pytest.raises(pydantic.ValidationError, match="max_particles"):
        Settings()


def test_api_keys_map_keys_to_tenants():
    assert parse_api_keys("tenantA:key1, tenantB:key2") == {"key1": "tenantA", "key2": "tenantB"}
    assert parse_api_keys("") == {}
    with pytest.raises(ValueError, match="api_keys"):
        parse_api_keys("tenantA")  # no key
    with pytest.raises(ValueError, match="api_keys"):
        parse_api_keys("a:k,b:k")  # one key for two tenants


def test_snapshot_key_and_updater_cache_size(monkeypatch):
    monkeypatch.delenv("MPFLOW_SNAPSHOT_KEY", raising=False)
    assert Settings().snapshot_key is None and Settings().updater_cache_size == 64
    monkeypatch.setenv("MPFLOW_SNAPSHOT_KEY", "s" * 32)
    s = Settings()
    assert s.snapshot_key.get_secret_value() == "s" * 32 and "s" * 32 not in repr(s)  # never printed
    monkeypatch.setenv("MPFLOW_SNAPSHOT_KEY", "short")
    with pytest.raises(pydantic.ValidationError, match="snapshot_key: at least 32"):
        Settings()
    monkeypatch.setenv("MPFLOW_SNAPSHOT_KEY", "")
    assert Settings().snapshot_key is None  # empty: generated and kept in the store
    monkeypatch.setenv("MPFLOW_UPDATER_CACHE_SIZE", "0")
    with pytest.raises(pydantic.ValidationError, match="updater_cache_size"):
        Settings()
