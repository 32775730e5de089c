"""`kestrel serve --dp-size`: each replica's command line and GPUs, and the error without the gateway."""
from __future__ import annotations

import pytest

from kestrel.cli import build_parser, config_from_args
from kestrel.config import EngineConfig
from kestrel.deploy import gateway
from kestrel.deploy.dp_launch import replica_gpus
from kestrel.deploy.replica_command import replica_command


def test_replica_command_gives_back_the_options_with_its_own_port():
    config = EngineConfig.from_flat(model="demo", device="cpu", dp_size=3, tp_size=2, port=31000, page_size=16,
                                    disable_radix_cache=True, api_key="k", ttft_target_ms=250.0, enable_lora=True,
                                    lora_paths=("a=/x", "b=/y"))
    command = replica_command(config, ["a", "b"], 31002)
    assert command[1:4] == ["-m", "kestrel.cli", "serve"]
    args = build_parser().parse_args(command[3:])
    replica = config_from_args(args)
    assert replica.parallel.dp_size == 1 and replica.server.port == 31002
    expected = EngineConfig.from_flat(model="demo", device="cpu", tp_size=2, port=31002, page_size=16,
                                      disable_radix_cache=True, api_key="k", ttft_target_ms=250.0, enable_lora=True,
                                      lora_paths=["a=/x", "b=/y"])  # as the command line gives it back
    assert replica == expected
    assert args.served_model_name == ["a", "b"]


def test_each_replica_gets_its_own_gpus():
    assert replica_gpus(2, 1, "cpu", None, 0) == [None, None]
    assert replica_gpus(2, 2, "cuda", None, 4) == ["0,1", "2,3"]
    assert replica_gpus(2, 1, "auto", ["3", "5", "7"], 0) == ["3", "5"]
    assert replica_gpus(2, 1, "auto", None, 0) == [None, None]  # no GPU: on the CPU
    with pytest.raises(ValueError, match="needs 4 GPUs; 3 are visible"):
        replica_gpus(2, 2, "cuda", ["0", "1", "2"], 0)
    with pytest.raises(ValueError, match="pins one GPU"):
        replica_gpus(2, 1, "cuda:1", None, 4)


def test_a_missing_gateway_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(gateway.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gateway.GatewayNotFound, match=r"pip install 'kestrel\[gateway\]'"):
        gateway.gateway_command("127.0.0.1", 30000, 30003, ["http://127.0.0.1:30001"], log_level="info",
                                shutdown_timeout=30, api_key=None)


def test_dp_size_with_several_nodes_is_refused():
    from kestrel.config_resolve import resolve_config

    with pytest.raises(ValueError, match="dp_size > 1 with nnodes > 1"):
        resolve_config(EngineConfig.from_flat(model="demo", device="cpu", dp_size=2, tp_size=2, nnodes=2,
                                              dist_init_addr="10.0.0.1:5000"))


def test_a_replica_that_exits_before_it_is_ready_stops_the_group_cleanly():
    """The gateway never started; the other replica, still running, is stopped (no traceback, status 1)."""
    import sys

    from kestrel.deploy.child import Child
    from kestrel.deploy.dp_launch import DataParallelGroup

    env = dict(__import__("os").environ)
    failing = Child("replica 0", [sys.executable, "-c", "raise SystemExit(3)"], env, "http://127.0.0.1:9/readiness")
    slow = Child("replica 1", [sys.executable, "-c", "import time; time.sleep(60)"], env, "http://127.0.0.1:9/readiness")
    gateway = Child("gateway", [sys.executable, "-c", "pass"], env, "http://127.0.0.1:9/readiness")
    assert DataParallelGroup([failing, slow], gateway, "http://127.0.0.1:9", shutdown_timeout=5).run() == 1
    assert gateway.proc is None and slow.exited() is not None
