"""Every service's settings: one frozen class per service on the common base, the
documented defaults, and a bad value refused before NATS is reached (exit status 2,
one line on stderr naming the variable)."""

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from libs.common import failpoints
from libs.common.settings import ProcessSettings, ServiceSettings
from libs.engine.model.default_model import cache_dir
from libs.transfer.settings import TransferSettings
from services.conductor.settings import ConductorSettings
from services.decode.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.prefill.settings import PrefillSettings
from services.store.settings import StoreSettings

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = {
    "gateway": GatewaySettings,
    "conductor": ConductorSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "store": StoreSettings,
}


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVSERVE_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("role", SETTINGS)
def test_each_service_has_one_frozen_settings_class_on_the_common_base(role, clean_env):
    settings = SETTINGS[role].from_env()
    assert isinstance(settings, ServiceSettings) and settings.role == role
    assert settings.instance_id.startswith(f"{role}-") and settings.nats_url == "nats://127.0.0.1:4222"
    assert settings.heartbeat_interval == 1.0 and settings.log_level == "INFO" and settings.nats_credentials is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.instance_id = "other"  # type: ignore[misc]


def test_the_documented_defaults(clean_env):
    gateway = GatewaySettings.from_env()
    assert (gateway.host, gateway.port, gateway.api_key, gateway.model, gateway.block_size) == ("127.0.0.1", 8000, None, None, 16)
    assert (gateway.max_model_len, gateway.max_attempts, gateway.request_timeout) == (None, 3, 120.0)
    assert (gateway.header_timeout, gateway.body_timeout, gateway.keepalive_timeout, gateway.max_connections) == (10.0, 30.0, 5.0, 1024)
    conductor = ConductorSettings.from_env()
    assert (conductor.policy, conductor.instance_timeout, conductor.slo_ttft_s, conductor.slo_tbt_s) == ("cache_aware+predictive_rejection", 3.0, 2.0, 0.15)
    assert (conductor.block_size, conductor.balancing_threshold, conductor.expected_output_tokens) == (16, 2.0, 512)
    prefill = PrefillSettings.from_env()
    assert (prefill.max_chunk_tokens, prefill.use_store, prefill.store_replicas) == (256, True, 1)
    assert prefill.enable_prefix_cache and prefill.transfer == TransferSettings()
    model = prefill.model
    assert (model.model, model.device, model.dtype, model.block_size, model.num_blocks, model.max_model_len) == (None, "cpu", "auto", 16, 512, None)
    assert model.calibrate and model.calibration_file is None
    decode = DecodeSettings.from_env()
    assert (decode.max_batch_size, decode.lease_seconds, decode.enable_prefix_cache) == (64, 30.0, True)
    assert decode.local_chunk_tokens == 512
    assert decode.model == model and decode.transfer == TransferSettings(listen_host="127.0.0.1", transport="auto", timeout=30.0,
                                                                         connections=4, max_connections=64, idle_timeout=60.0)  # fmt: skip
    store = StoreSettings.from_env()
    assert (store.directory, store.capacity_bytes, store.disk_bytes, store.write_behind_s) == (None, 1 << 30, 16 << 30, 1.0)


def test_variables_reach_the_settings(clean_env):
    clean_env.setenv("KVSERVE_SLO_TTFT_MS", "500")
    clean_env.setenv("KVSERVE_POLICY", "least_loaded")
    clean_env.setenv("KVSERVE_LOG_LEVEL", "DEBUG")
    clean_env.setenv("KVSERVE_STORE_DIR", "~/kv")
    clean_env.setenv("KVSERVE_INSTANCE_ID", "x-1")
    conductor = ConductorSettings.from_env()
    assert (conductor.slo_ttft_s, conductor.policy, conductor.log_level, conductor.instance_id) == (0.5, "least_loaded", "DEBUG", "x-1")
    assert StoreSettings.from_env().directory == Path("~/kv").expanduser()


@pytest.mark.parametrize(("role", "variable", "value"), [
    ("gateway", "KVSERVE_GATEWAY_MAX_ATTEMPTS", "0"),
    ("gateway", "KVSERVE_GATEWAY_ADMIT_RETRY_WINDOW", "-1"),
    ("gateway", "KVSERVE_GATEWAY_DRAIN_TIMEOUT", "-1"),
    ("gateway", "KVSERVE_GATEWAY_PORT", "http"),
    ("conductor", "KVSERVE_SLO_TBT_MS", "-1"),
    ("conductor", "KVSERVE_POLICY", "fastest"),
    ("prefill", "KVSERVE_STORE_REPLICAS", "0"),
    ("prefill", "KVSERVE_NUM_BLOCKS", "0"),
    ("decode", "KVSERVE_LEASE_SECONDS", "0"),
    ("decode", "KVSERVE_LOCAL_CHUNK_TOKENS", "0"),
    ("decode", "KVSERVE_TRANSPORT", "pigeon"),
    ("decode", "KVSERVE_DEVICE", "cuda:0"),
    ("prefill", "KVSERVE_DEVICE", "mps"),
    ("store", "KVSERVE_STORE_CAPACITY_BYTES", "0"),
    ("store", "KVSERVE_STORE_WRITE_BEHIND_S", "soon"),
])  # fmt: skip
def test_a_bad_value_is_refused_with_its_name(role, variable, value, clean_env):
    clean_env.setenv(variable, value)
    with pytest.raises(ValueError, match=variable):
        SETTINGS[role].from_env()


def test_what_every_process_reads_alike(clean_env, tmp_path):
    settings = ProcessSettings.from_env()
    assert (settings.cache_dir, settings.native_kernels) == (Path("~/.cache/kvserve").expanduser(), True)
    assert (settings.failpoints, settings.instance_id) == ("", None)
    clean_env.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    clean_env.setenv("KVSERVE_NATIVE_KERNELS", "0")
    clean_env.setenv("CC", "clang")
    settings = ProcessSettings.from_env()
    assert (settings.cache_dir, settings.native_kernels, settings.compiler) == (tmp_path, False, "clang")
    assert cache_dir() == tmp_path


def test_failpoints_armed_bare_or_for_this_instance_only():
    spec = "store.stall_disk_write, decode-0:transfer.stall_receive,prefill-0:prefill.stall_before_compute,"
    assert failpoints.parse(spec, "decode-0") == {"store.stall_disk_write", "transfer.stall_receive"}
    assert failpoints.parse(spec, None) == {"store.stall_disk_write"}
    assert failpoints.parse("", "decode-0") == frozenset()


def closed_port_url() -> str:
    """A NATS URL nothing listens on: a service that got as far as connecting would retry forever."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(("role", "variable", "value"), [
    ("gateway", "KVSERVE_GATEWAY_PORT", "70000"),
    ("conductor", "KVSERVE_SLO_TTFT_MS", "fast"),
    ("prefill", "KVSERVE_STORE_REPLICAS", "0"),
    ("decode", "KVSERVE_TRANSPORT", "pigeon"),
    ("store", "KVSERVE_STORE_CAPACITY_BYTES", "0"),
])  # fmt: skip
def test_a_service_with_a_bad_value_exits_2_with_one_line_naming_it(role, variable, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    env.update(KVSERVE_NATS_URL=closed_port_url(), KVSERVE_CACHE_DIR=os.environ["KVSERVE_CACHE_DIR"], **{variable: value})
    # The timeout only ends a run that hangs connecting; a refused start returns long before it.
    result = subprocess.run([sys.executable, "-m", f"services.{role}"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"{role}: {variable}"), result.stderr
