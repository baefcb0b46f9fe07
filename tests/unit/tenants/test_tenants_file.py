"""The tenants file and `kvserve tenants`: keys stored hashed and found by key,
written 0600 and atomically, bad files refused naming the field."""

import os
import stat

import pytest

from kvserve.cli.main import main
from libs.common import tenants as tenants_file
from libs.common.tenants import Quotas, Tenant, Tenants, TenantsFileError


def test_a_key_finds_its_tenant_and_nothing_else_does():
    alice, bob = tenants_file.new_key(), tenants_file.new_key()
    found = Tenants({"alice": Tenant("alice", (tenants_file.hash_key(alice),)),
                     "bob": Tenant("bob", (tenants_file.hash_key(bob),))}, b"s")  # fmt: skip
    assert found.find(alice).name == "alice"
    assert found.find(bob).name == "bob"
    assert found.find("kvs-wrong") is None
    assert found.find(tenants_file.hash_key(alice)) is None  # the stored hash is not a key


def test_the_file_round_trips_and_stores_no_key():
    key = tenants_file.new_key()
    tenant = Tenant("alice", (tenants_file.hash_key(key),), 2.5, Quotas(60, 1000, 4, 128), "public", True)
    written = Tenants({"alice": tenant, "bob": Tenant("bob"), "root": Tenant("root", admin=True)}, b"abc")
    text = tenants_file.dumps(written)
    assert key not in text
    assert tenants_file.parse(text) == written
    assert [t.admin for t in tenants_file.parse(text).tenants.values()] == [False, False, True]


@pytest.mark.parametrize("text, words", [
    ("[tenants.a]\nweight = 0", "weight"),
    ("[tenants.a]\nkeys = ['plain-key']", "keys"),
    ("[tenants.a]\nmax_concurrent = -1", "max_concurrent"),
    ("[tenants.a]\ncolour = 'red'", "colour"),
    ("[tenants.'a b']\n", "tenant name"),
    ("[tenants.a]\ncache_scope = 'x y'", "cache_scope"),
    ("[tenants.a]\nadmin = 'yes'", "admin"),
    ("[tenants.a\n", "not TOML"),
])  # fmt: skip
def test_a_bad_file_is_refused_naming_what_is_wrong(text, words):
    with pytest.raises(TenantsFileError, match=words):
        tenants_file.parse(text)


def test_scopes_differ_by_tenant_and_by_secret_and_a_shared_scope_is_shared():
    t = Tenants({}, b"secret")
    a, b = Tenant("a"), Tenant("b")
    assert t.scope_bytes(a) != t.scope_bytes(b)
    assert t.scope_bytes(a) != Tenants({}, b"other").scope_bytes(a)
    assert t.scope_bytes(Tenant("a", cache_scope="pub")) == t.scope_bytes(Tenant("b", cache_scope="pub"))
    assert t.scope_bytes(Tenant("a", cache_scope="pub")) != t.scope_bytes(a)


def test_the_cli_adds_lists_rotates_and_removes(tmp_path, capsys):
    path = tmp_path / "tenants.toml"
    assert main(["tenants", "add", "alice", "--file", str(path), "--weight", "2", "--requests-per-minute", "60",
                 "--cache-scope", "pub"]) == 0  # fmt: skip
    key = capsys.readouterr().out.strip()
    assert key.startswith(tenants_file.KEY_PREFIX)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert key not in path.read_text()
    read = tenants_file.read(path)
    assert read.find(key).name == "alice"
    assert (read.tenants["alice"].weight, read.tenants["alice"].quotas.requests_per_minute) == (2.0, 60)
    secret = read.scope_secret
    assert len(secret) == 64

    assert not read.tenants["alice"].admin
    assert main(["tenants", "add", "root", "--file", str(path), "--admin"]) == 0
    capsys.readouterr()
    assert tenants_file.read(path).tenants["root"].admin

    assert main(["tenants", "rotate-key", "alice", "--file", str(path)]) == 0
    new_key = capsys.readouterr().out.strip()
    read = tenants_file.read(path)
    assert (read.find(key), read.find(new_key).name) == (None, "alice")
    assert read.scope_secret == secret  # a new key keeps the tenant's cache
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    assert main(["tenants", "list", "--file", str(path)]) == 0
    listed = capsys.readouterr().out
    assert "alice" in listed and new_key not in listed and "requests_per_minute=60" in listed
    assert [line.endswith("(admin)") for line in listed.splitlines()[1:]] == [False, True]

    assert main(["tenants", "remove", "alice", "--file", str(path)]) == 0
    assert main(["tenants", "remove", "root", "--file", str(path)]) == 0
    assert tenants_file.read(path).tenants == {}
    assert sorted(os.listdir(tmp_path)) == ["tenants.toml"]  # no temporary file left behind


def test_the_cli_refuses_a_duplicate_and_an_unknown_tenant(tmp_path, capsys):
    path = str(tmp_path / "t.toml")
    main(["tenants", "add", "alice", "--file", path])
    with pytest.raises(SystemExit, match="exists"):
        main(["tenants", "add", "alice", "--file", path])
    with pytest.raises(SystemExit, match="no tenant"):
        main(["tenants", "rotate-key", "bob", "--file", path])
    with pytest.raises(SystemExit, match="weight"):
        main(["tenants", "add", "carol", "--file", path, "--weight", "0"])


def test_kvserve_up_refuses_a_bad_tenants_file_before_starting_anything(tmp_path, capsys):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nweight = -1\n")
    assert main(["up", "--tenants", str(path)]) == 2
    assert "weight" in capsys.readouterr().err
    assert main(["up", "--tenants", str(tmp_path / "missing.toml")]) == 2


def test_a_store_share_is_read_written_and_checked_and_names_no_secret():
    text = tenants_file.dumps(Tenants({"a": Tenant("a", store_share=0.25), "b": Tenant("b")}, b"s"))
    assert "store_share = 0.25" in text
    assert tenants_file.parse(text).tenants["a"].store_share == 0.25
    assert tenants_file.parse(text).tenants["b"].store_share is None
    for bad in ("0", "1.5", "true", "'half'"):
        with pytest.raises(TenantsFileError, match="store_share must be a number in"):
            tenants_file.parse(f"[tenants.a]\nstore_share = {bad}")
    # the stores count blocks under the scope's name, never its secret
    assert Tenants.cache_owner(Tenant("a")).name == "tenant/a"
    assert Tenants.cache_owner(Tenant("c", cache_scope="pub")).name == "shared/pub"
