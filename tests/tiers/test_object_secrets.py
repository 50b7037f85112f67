"""Any `storage_options` entry named like a credential (key, secret, token, password,
credential; any case, any depth) is scrubbed from the object tier's errors, log lines and
stats, and masked when a config is printed: not only S3's own option names."""

from __future__ import annotations

import logging

import numpy as np
from fsspec.implementations.memory import MemoryFileSystem

from kvstrata.config import ObjectTierConfig, is_secret_option, secret_values
from kvstrata.tiers.object_store import ObjectTier
from tests.utils import key

PLANTED = {
    "account_key": "planted-azure-account-key-1",  # Azure (adlfs)
    "sas_token": "planted-azure-sas-token-2",
    "Password": "planted-password-3",
    "client_kwargs": {"api_credential": "planted-credential-4", "region_name": "not-a-secret"},
    "token": "planted-gcs-token-5",
}
VALUES = ["planted-azure-account-key-1", "planted-azure-sas-token-2", "planted-password-3", "planted-credential-4",
          "planted-gcs-token-5"]  # fmt: skip


class QuotingFileSystem(MemoryFileSystem):
    """A client library that quotes the credentials it was given in its errors."""

    def pipe_file(self, path, value, **kwargs):
        raise PermissionError(f"access denied for {' / '.join(VALUES)}")

    def cat_file(self, path, start=None, end=None, **kwargs):
        raise PermissionError(f"access denied for {' / '.join(VALUES)}")


def test_credentials_of_any_backend_are_scrubbed_from_errors_logs_and_stats(caplog):
    config = ObjectTierConfig(url="memory://bucket/kv", storage_options=PLANTED, client="fsspec", max_attempts=1)
    tier = ObjectTier(config, filesystem=(QuotingFileSystem(skip_instance_cache=True), "bucket/kv"))
    try:
        with caplog.at_level(logging.DEBUG):
            assert tier.put_many("ns", [(key(0), np.ones(64, dtype=np.uint8))]) == [False]
            probe = tier.probe("secret-test")
        outputs = {"probe": str(probe), "stats": repr(tier.stats()), "log": "\n".join(r.getMessage() for r in caplog.records),
                   "repr": repr(config), "str": str(config)}  # fmt: skip
    finally:
        tier.close()
    assert "access denied" in outputs["stats"] and "access denied" in outputs["probe"]  # the reason stays
    assert "not-a-secret" in outputs["repr"]  # what is not a credential still shows
    leaks = {name: [value for value in VALUES if value in text] for name, text in outputs.items()}
    assert not any(leaks.values()), leaks


def test_secret_option_names():
    for name in ("key", "secret", "token", "aws_session_token", "account_key", "sas_token", "Password", "credentials",
                 "client_secret", "API_KEY", "username"):  # fmt: skip
        assert is_secret_option(name), name
    for name in ("region_name", "endpoint_url", "anon", "use_ssl", "client_kwargs", "config_kwargs", 3):
        assert not is_secret_option(name), name
    assert sorted(secret_values(PLANTED)) == sorted(VALUES)
