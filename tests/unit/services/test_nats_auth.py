"""NATS credentials files, the files nats-server and the services read, and URL redaction
(no server needed: tests/integration/test_nats_auth.py runs these against a real one)."""

import json
import logging
import os
import stat

import pytest

from libs.common import nats_auth
from libs.common.nats_auth import NatsAuthError, NatsCredentials, load_credentials, redact_url
from libs.common.settings import ServiceSettings
from libs.protocol import subjects


def private_file(path, text: str):
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_credentials_file_holds_a_user_and_password_or_a_token(tmp_path):
    user = load_credentials(private_file(tmp_path / "u.json", '{"user": "prefill", "password": "pw-1"}'))
    assert user == NatsCredentials(user="prefill", password="pw-1")
    assert user.connect_options() == {"user": "prefill", "password": "pw-1"}
    token = load_credentials(private_file(tmp_path / "t.json", '{"token": "tok-1"}'))
    assert token.connect_options() == {"token": "tok-1"}
    assert "pw-1" not in repr(user) and "tok-1" not in repr(token)


@pytest.mark.parametrize(
    "text",
    ['{"user": "prefill"}', '{"user": "prefill", "password": ""}', '{"token": "t", "user": "u", "password": "p"}',
     '{"user": "prefill", "password": 5}', '["prefill", "pw"]', "user=prefill", ""],
)  # fmt: skip
def test_a_credentials_file_that_cannot_be_used_says_why_without_its_content(tmp_path, text):
    path = private_file(tmp_path / "bad.json", text)
    with pytest.raises(NatsAuthError, match=str(path)) as caught:
        load_credentials(path)
    assert "pw" not in str(caught.value) and "prefill" not in str(caught.value)


def test_a_missing_credentials_file_is_named(tmp_path):
    with pytest.raises(NatsAuthError, match="cannot read the NATS credentials file .*missing.json"):
        load_credentials(tmp_path / "missing.json")


def test_a_credentials_file_others_can_read_is_used_with_a_warning(tmp_path, caplog):
    path = tmp_path / "open.json"
    path.write_text('{"token": "tok"}')
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvserve.nats"):
        assert load_credentials(path).token == "tok"
    assert "open to other users (mode 644): chmod 600 it" in caplog.text


def test_a_service_refuses_to_start_with_a_credentials_file_it_cannot_use(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_NATS_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="KVSERVE_NATS_CREDENTIALS: cannot read"):
        ServiceSettings.from_env("prefill")
    path = private_file(tmp_path / "ok.json", '{"user": "prefill", "password": "pw"}')
    monkeypatch.setenv("KVSERVE_NATS_CREDENTIALS", str(path))
    assert ServiceSettings.from_env("prefill").nats_credentials == str(path)


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://s3cret@nats:4222", "nats://***@nats:4222"),
        ("nats://gateway:p@ss@nats:4222", "nats://***@nats:4222"),
        ("tls://u:p@a:4222,tls://u:p@b:4222", "tls://***@a:4222,tls://***@b:4222"),
        ("u:p@nats:4222", "***@nats:4222"),
    ],
)
def test_a_logged_url_carries_no_credentials(url, redacted):
    assert redact_url(url) == redacted


ROLES = nats_auth.role_identities()
USERS = [identity.user for identity in ROLES]
INSTANCES = nats_auth.instance_identities({"decode-0": "decode", "decode-1": "decode", "store-0": "store"})


def test_passwords_derived_from_one_secret_are_stable_and_differ_by_user():
    first, again = nats_auth.derived_passwords("x" * 32, ROLES), nats_auth.derived_passwords("x" * 32, ROLES)
    assert first == again and set(first) == set(USERS)
    assert len(set(first.values())) == len(USERS)
    assert first != nats_auth.derived_passwords("y" * 32, ROLES)
    each = nats_auth.derived_passwords("x" * 32, INSTANCES)
    assert set(each) == {"decode-0", "decode-1", "store-0", "observer", "admin"}
    assert each["decode-0"] != each["decode-1"] and each["observer"] == first["observer"]
    with pytest.raises(NatsAuthError, match="at least 16 characters"):
        nats_auth.derived_passwords("change-me", ROLES)


def test_the_files_are_private_and_agree_with_each_other(tmp_path):
    stale = tmp_path / "auth" / "prefill"
    stale.mkdir(parents=True, mode=0o755)
    (stale / "credentials.json").write_text("old")
    (stale / "credentials.json").chmod(0o644)
    passwords = nats_auth.random_passwords(ROLES)
    files = nats_auth.write_auth_files(tmp_path / "auth", ROLES, passwords)
    config = files.server_config.read_text()
    body = json.loads(config[config.index("{") :])  # nats-server reads it; so does JSON
    users = {u["user"]: u for u in body["authorization"]["users"]}
    assert set(users) == set(USERS) == set(files.users)
    for user in USERS:
        path = files.credentials(user)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert load_credentials(path) == NatsCredentials(user=user, password=users[user]["password"])
        assert users[user]["password"] == passwords[user]
    assert stat.S_IMODE(files.server_config.stat().st_mode) == 0o600
    assert not [name for name in os.listdir(stale) if name.endswith(".partial")]
    with pytest.raises(KeyError, match="no NATS user 'decode-0'"):
        files.credentials("decode-0")


def grants(identities) -> dict[str, dict]:
    users = json.loads(nats_auth.server_config(identities, nats_auth.random_passwords(identities)).split("\n", 1)[1])
    return {u["user"]: u["permissions"] for u in users["authorization"]["users"]}


def test_only_services_answer_requests_and_only_workers_publish_tokens():
    permissions = grants(ROLES)
    assert {u for u, p in permissions.items() if p.get("allow_responses")} == set(nats_auth.SERVICE_ROLES)
    assert {u for u, p in permissions.items() if "kvserve.tokens.*.*" in p["publish"]["allow"]} == {"prefill", "decode"}
    for user, allowed in permissions.items():  # replies: each user reads its own only
        inboxes = {s for s in allowed["subscribe"]["allow"] if s.startswith("_INBOX")}
        assert inboxes <= {f"_INBOX.{user}.>"}, user


def test_an_instances_user_names_its_own_subjects_only():
    permissions = grants(INSTANCES)
    decode = permissions["decode-0"]
    assert decode["publish"]["allow"][2:3] == ["kvserve.tokens.*.decode-0"]  # after heartbeat and roll call
    assert set(decode["subscribe"]["allow"]) == {
        "kvserve.rollcall", "kvserve.metrics.decode-0", "kvserve.decode.decode-0.reserve",
        "kvserve.decode.decode-0.admit", "kvserve.decode.decode-0.release", "kvserve.decode.decode-0.prefill",
        "kvserve.decode.decode-0.resend",
        "kvserve.cancel",
    }  # fmt: skip
    assert "kvserve.kv.events.store-0" in permissions["store-0"]["publish"]["allow"]
    assert set(permissions["store-0"]["subscribe"]["allow"]) == {
        "kvserve.rollcall", "kvserve.metrics.store-0", "kvserve.store.store-0.*", "kvserve.kv.snapshot.store-0"}
    any_instance = {subjects.TOKENS_ALL, subjects.KV_EVENTS_ALL, subjects.KV_SNAPSHOT_ALL, subjects.METRICS_ALL,
                    subjects.DECODE_RESERVE_ALL, subjects.STORE_OPS_ALL, subjects.heartbeats("decode"),
                    subjects.heartbeats("store"), "_INBOX.decode.>", "_INBOX.store.>"}  # fmt: skip
    for user in ("decode-0", "decode-1", "store-0"):
        allowed = permissions[user]["publish"]["allow"] + permissions[user]["subscribe"]["allow"]
        assert not any_instance & set(allowed), user


@pytest.mark.parametrize(("instances", "error"), [
    ({"decode": "decode"}, "that is a role's user"),
    ({"decode.0": "decode"}, "cannot be used in a NATS subject"),
    ({"decode-0": "cook"}, "no such role"),
])  # fmt: skip
def test_an_instance_that_cannot_have_a_user_of_its_own_is_refused(instances, error):
    with pytest.raises(NatsAuthError, match=error):
        nats_auth.instance_identities(instances)
