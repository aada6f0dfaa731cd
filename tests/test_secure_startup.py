"""Start-up refusals and secrets (issue 15, parts 5-7): empty API keys, keys-file lines reported
by number and never echoed, keys from TANDEM_API_KEYS, the gateway's constant-time key lookup,
the Ray token-authentication check, and `tandem status --json`'s shape.  No Ray cluster and no
worker is started: the check and the formatting functions are called directly."""

from __future__ import annotations

import dataclasses
import json

import pytest
from starlette.requests import Request

from deploy.cli import build_parser, main, serve_settings
from deploy.settings import check_ray_auth
from deploy.status import format_json, format_text, worker_report
from gateway.admission import Rejected
from gateway.app import Gateway
from gateway.config import GatewayConfig, KeyTable, api_keys, load_api_keys

SECRET = "sk-very-secret-0123456789"


def _config(api_keys: dict[str, str]) -> GatewayConfig:
    """A gateway config with one (unreachable) colocated worker, and a cluster secret where the
    config carries one."""
    names = {f.name for f in dataclasses.fields(GatewayConfig)}
    kw = {"cluster_secret": b"s" * 32} if "cluster_secret" in names else {}
    return GatewayConfig(colocated_workers=("127.0.0.1:1",), api_keys=api_keys, **kw)


@pytest.mark.parametrize("spec", ["", ":admin", " :acme"])
def test_an_empty_api_key_flag_is_refused(spec):
    with pytest.raises(ValueError, match="empty API key"):
        api_keys(None, [spec])


def test_serve_refuses_an_empty_key_before_starting_anything(capsys):
    assert main(["serve", "--api-key", ":admin"]) == 2
    assert "empty API key" in capsys.readouterr().err


def test_the_gateway_config_refuses_an_empty_key():
    with pytest.raises(ValueError, match="empty API key"):
        _config({"": "admin"})


def test_a_bad_keys_file_line_is_reported_by_number_and_not_echoed(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# keys\nsk-good acme\n\n{SECRET} acme extra-field\n")
    with pytest.raises(ValueError) as err:
        load_api_keys(path)
    assert "line 4" in str(err.value)
    assert SECRET not in str(err.value) and "acme" not in str(err.value)


def test_a_keys_file_one_field_line_is_not_echoed(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"{SECRET}\n")
    with pytest.raises(ValueError, match="line 1") as err:
        load_api_keys(path)
    assert SECRET not in str(err.value)


def test_keys_come_from_the_environment_variable(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("sk-file acme\nsk-both filetenant\n")
    keys = api_keys(path, ["sk-flag:flagged"], env="sk-env1:globex, sk-env2 ,sk-both:envtenant,")
    assert keys == {"sk-file": "acme", "sk-both": "envtenant", "sk-env1": "globex", "sk-env2": "default",
                    "sk-flag": "flagged"}


def test_an_empty_key_in_the_environment_variable_is_refused():
    with pytest.raises(ValueError, match="TANDEM_API_KEYS entry 2"):
        api_keys(None, [], env="sk-a:acme,:admin")


def test_serve_reads_keys_from_tandem_api_keys(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEYS", "sk-env:globex")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    settings = serve_settings(build_parser().parse_args(["serve", "--api-key", "sk-flag"]))
    assert settings.gateway.api_keys == {"sk-env": "globex", "sk-flag": "default"}


def test_the_key_table_finds_the_tenant_of_the_right_key_only():
    table = KeyTable({"sk-a": "acme", "sk-b": "globex"})
    assert table.tenant("sk-a") == "acme" and table.tenant("sk-b") == "globex"
    for wrong in ("", "sk-", "sk-a ", "sk-c", "SK-A", "sk-ab"):
        assert table.tenant(wrong) is None
    assert not KeyTable({})


def _request(auth: str | None) -> Request:
    headers = [(b"authorization", auth.encode())] if auth is not None else []
    return Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": headers})


def test_the_gateway_answers_401_to_a_wrong_key_and_the_tenant_to_the_right_one():
    gw = Gateway(_config({"sk-a": "acme", "sk-b": "globex"}))
    assert gw.tenant(_request("Bearer sk-a")) == "acme"
    assert gw.tenant(_request("bearer sk-b")) == "globex"
    for auth in (None, "", "Bearer ", "Bearer sk-c", "sk-a", "Basic sk-a"):
        with pytest.raises(Rejected) as err:
            gw.tenant(_request(auth))
        assert err.value.status == 401


@pytest.mark.parametrize("mode", [None, "", "disabled", "Disabled"])
def test_joining_a_ray_cluster_without_token_auth_is_refused(mode):
    with pytest.raises(ValueError, match="--allow-insecure-ray") as err:
        check_ray_auth("10.0.0.1:6379", mode, allow_insecure=False)
    assert "RAY_AUTH_MODE=token" in str(err.value)


def test_the_flag_turns_the_refusal_into_a_warning():
    warning = check_ray_auth("auto", None, allow_insecure=True)
    assert warning is not None and "--allow-insecure-ray" in warning


@pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379", None])
def test_token_auth_passes(address):
    assert check_ray_auth(address, "token", allow_insecure=False) is None


def test_a_local_cluster_passes_unless_token_auth_is_turned_off():
    assert check_ray_auth(None, None, allow_insecure=False) is None      # Ray turns tokens on itself
    with pytest.raises(ValueError, match="local Ray cluster"):
        check_ray_auth(None, "disabled", allow_insecure=False)


def test_serve_refuses_an_insecure_ray_address(monkeypatch, capsys):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert main(["serve", "--address", "auto"]) == 2
    assert "RAY_AUTH_MODE" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--address", "auto", "--allow-insecure-ray"])
    assert serve_settings(args).address == "auto"


REGISTRY = [
    {"worker_id": "decode-0", "role": "decode", "address": "127.0.0.1:50052", "node_ip": "127.0.0.1",
     "node_id": "n1", "transfer_endpoint": "grpc://127.0.0.1:50061", "tls": True},
    {"worker_id": "prefill-0", "role": "prefill", "address": "127.0.0.1:50051", "node_ip": "127.0.0.1",
     "node_id": "n1", "transfer_endpoint": None, "tls": True},
]


def _fake_stats(w: dict) -> dict:
    if w["role"] == "prefill":
        return {"health": "unavailable", "kv_tokens_used": None, "kv_tokens_capacity": None, "expert_hit_rate": None}
    return {"health": "ok", "kv_tokens_used": 32, "kv_tokens_capacity": 16384, "expert_hit_rate": 0.75,
            "expert_formats": ["gptq int4 g128 sym"]}


def test_status_json_lists_every_worker():
    out = json.loads(format_json([worker_report(w, _fake_stats) for w in REGISTRY]))
    assert [w["worker_id"] for w in out["workers"]] == ["decode-0", "prefill-0"]
    for w in out["workers"]:
        assert set(w) - {"expert_formats"} == {"worker_id", "role", "node_ip", "node_id", "address",
                                               "transfer_endpoint", "tls", "health", "kv_tokens_used",
                                               "kv_tokens_capacity", "expert_hit_rate"}
        assert w["tls"] is True
    decode, prefill = out["workers"]
    assert (decode["role"], decode["health"], decode["kv_tokens_used"], decode["kv_tokens_capacity"]) == \
        ("decode", "ok", 32, 16384)
    assert decode["transfer_endpoint"] == "grpc://127.0.0.1:50061" and prefill["transfer_endpoint"] is None
    assert prefill["health"] == "unavailable" and prefill["kv_tokens_capacity"] is None


def test_status_text_keeps_the_table():
    lines = format_text([worker_report(w, _fake_stats) for w in REGISTRY]).splitlines()
    assert lines[0].split()[:5] == ["worker", "role", "node", "address", "health"]
    assert "32/16384" in lines[1] and "0.750" in lines[1] and lines[1].endswith("gptq int4 g128 sym")
    assert lines[2].split()[4] == "unavailab"[:8] and lines[2].rstrip().endswith("-")


def test_status_has_a_json_flag():
    assert build_parser().parse_args(["status", "--json"]).json


def test_tls_is_on_across_nodes_unless_turned_off():
    from deploy.settings import ServeSettings
    from engine.options import build
    assert not ServeSettings().use_tls(1) and ServeSettings().use_tls(2)
    assert ServeSettings(tls="on").use_tls(1) and not ServeSettings(tls="off").use_tls(3)
    with pytest.raises(ValueError, match="--tls"):
        ServeSettings(tls="maybe")
    with pytest.raises(ValueError, match="both --ssl-certfile and --ssl-keyfile"):
        build(ServeSettings, ssl_certfile=__file__)


def test_tandem_certs_writes_one_private_directory_per_process(tmp_path, capsys):
    import stat

    from kv_transfer.tls import TlsIdentity
    assert main(["certs", str(tmp_path / "c"), "decode-0", "prefill-0", "gateway", "--host", "10.0.0.7"]) == 0
    out = capsys.readouterr().out
    assert "PRIVATE" not in out and "BEGIN" not in out
    idents = {n: TlsIdentity.load(tmp_path / "c" / n) for n in ("decode-0", "prefill-0", "gateway")}
    assert len({i.ca_pem for i in idents.values()}) == 1                  # one CA
    assert all(stat.S_IMODE((tmp_path / "c" / n / "key.pem").stat().st_mode) == 0o600 for n in idents)
    assert main(["certs", str(tmp_path / "d"), "../escape"]) == 2
    assert not (tmp_path / "escape").exists()


def test_serve_passes_the_fairness_settings_to_the_gateway():
    args = build_parser().parse_args(["serve", "--default-max-tokens", "64", "--tenant-max-kv-tokens", "4096"])
    s = serve_settings(args)
    assert (s.gateway.default_max_tokens, s.gateway.tenant_max_kv_tokens) == (64, 4096)
    with pytest.raises(ValueError, match="tenant_max_kv_tokens=0 must be >= 1"):
        serve_settings(build_parser().parse_args(["serve", "--tenant-max-kv-tokens", "0"]))


def test_serve_takes_admin_keys_from_the_environment_only(monkeypatch):
    monkeypatch.setenv("TANDEM_ADMIN_KEYS", "ops-1,ops-2")
    s = serve_settings(build_parser().parse_args(["serve", "--stream-idle-timeout", "5"]))
    assert s.gateway.admin_keys == ("ops-1", "ops-2") and s.gateway.stream_idle_timeout_s == 5
    assert "ops-1" not in repr(s)
    monkeypatch.setenv("TANDEM_ADMIN_KEYS", "ops-1,")
    with pytest.raises(ValueError, match="empty key"):
        serve_settings(build_parser().parse_args(["serve"]))
