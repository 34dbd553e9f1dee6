"""The benchmark tools run and report what they say: `isoserve bench --roofline` on a tiny model
with tiny sizes, and bench/build_llama_server.sh parses as bash. No timing is asserted beyond
being positive: these are measurements, not targets."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from isoserve.bench import roofline
from isoserve.cli import main as isoserve_main
from isoserve.config import dtype_name

ROOT = Path(__file__).resolve().parent.parent


def test_roofline_reports_every_field(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "roofline.json"
    rc = isoserve_main(["bench", "--roofline", "--model", str(tiny_llama_dir), "--batch", "1,2",
                        "--prompt-tokens", "8", "--output-tokens", "4", "--roofline-mib", "8",
                        "--roofline-square", "128", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "== roofline:" in printed and "isoserve / ideal" in printed

    data = json.loads(out.read_text())
    assert data["floor_dtype"] == dtype_name("auto")  # the CPU's native dtype, as issue 6 counts floors
    assert data["peak_flops"] > 0 and data["bandwidth"]["bytes_per_s"] > 0
    # Measured before and after the steps; the better of the two sets the floors.
    runs = data["bandwidth"]["runs"]
    assert len(runs) == 2 and data["bandwidth"]["bytes_per_s"] == max(run["bytes_per_s"] for run in runs)
    assert data["matmuls"] and all(m["flops"] > 0 for m in data["matmuls"])
    # Where torch multiplies int8 with the CPU's byte dot products (AVX512-VNNI, AMX) every row
    # has an int8 floor; elsewhere torch._int_mm is a plain loop and the floor is left out.
    int8 = roofline.int8_matmul_unavailable() == ""
    if int8:
        assert data["int8_peak_ops"] > 0 and len(data["int8_matmuls"]) == len(data["matmuls"])
        assert data["int8_unavailable"] == ""
    else:
        assert data["int8_peak_ops"] is None and data["int8_matmuls"] == []
        assert "no fast path" in data["int8_unavailable"] and "int8 n/a" in printed
    costs = data["model_costs"]
    assert 0 < costs["matmul_parameters"] <= costs["parameters"]  # the tiny model is untied
    assert costs["weight_bytes"] > 0
    assert [r["batch"] for r in data["results"]] == [1, 2]
    for row in data["results"]:
        for key in ("weight_bytes", "bytes", "flops", "memory_floor_s", "compute_floor_s", "ideal_s",
                    "measured_s", "measured_over_ideal", "measured_over_memory_floor"):
            assert row[key] > 0, key
        assert row["ideal_s"] == max(row["memory_floor_s"], row["compute_floor_s"])
        assert row["memory_floor_s"] == pytest.approx(row["bytes"] / data["bandwidth"]["bytes_per_s"])
        matmul_flops = row["batch"] * 2 * costs["matmul_parameters"]
        if int8:
            assert row["int8_compute_floor_s"] == pytest.approx(
                matmul_flops / data["int8_peak_ops"] + (row["flops"] - matmul_flops) / data["peak_flops"])
            assert row["measured_over_int8_floor"] == pytest.approx(row["measured_s"] / row["int8_compute_floor_s"])
        else:
            assert row["int8_compute_floor_s"] is None and row["measured_over_int8_floor"] is None
        assert row["isoserve"]["decode_steps"] >= 1
        assert row["isoserve"]["guard_seconds_median"] > 0 and 0 < row["isoserve"]["guard_share"] < 1
        # A safetensors model has no GGUF blocks: the step reads every weight in bfloat16.
        assert row["read_weight_bytes"] == row["weight_bytes"] and row["read_floor_s"] > 0
    one, two = data["results"]
    assert two["flops"] == pytest.approx(2 * one["flops"])  # FLOPs grow with the batch ...
    assert two["weight_bytes"] == one["weight_bytes"]        # ... the weights read do not


def test_int8_floor_needs_byte_dot_products():
    """The int8 floor is measured only where torch._int_mm has VNNI or AMX to run on; an AVX2
    CPU's plain loop (0.005 TOP/s on a Zen 3) is no floor."""
    assert roofline.int8_matmul_unavailable("avx avx2 fma f16c") != ""
    assert "no fast path" in roofline.int8_matmul_unavailable("")
    assert roofline.int8_matmul_unavailable("avx2 avx512f avx512bw avx512_vnni") == ""
    assert roofline.int8_matmul_unavailable("avx2 amx_tile amx_int8") == ""
    assert roofline.int8_matmul_unavailable("avx2 amx_tile amx_bf16") != ""  # AMX without its int8 part


def test_the_roofline_table_shows_a_missing_int8_floor_as_na():
    """Where the int8 floor is left out (a CPU without VNNI or AMX), the table says n/a in its
    columns and its title; where it was measured, it shows the figures."""
    row = {"batch": 32, "weight_bytes": 538e6, "kv_bytes": 121e6, "flops": 9e9, "memory_floor_s": 0.018,
           "compute_floor_s": 0.05, "ideal_s": 0.05, "measured_s": 0.045, "measured_over_ideal": 0.9,
           "measured_over_memory_floor": 2.5, "read_weight_bytes": 111.6e6, "read_floor_s": 0.0064,
           "measured_over_read_floor": 7.0, "int8_compute_floor_s": None, "measured_over_int8_floor": None,
           "isoserve": {"guard_seconds_median": 8e-5, "guard_share": 0.0018}}
    run = {"model": "m", "dtype": "float32", "torch_threads": 2, "peak_flops": 1.8e11,
           "bandwidth": {"bytes_per_s": 3.6e10}, "int8_peak_ops": None, "context_tokens": 164, "results": [row]}
    cells = roofline.cells(row)
    assert cells[roofline.HEADERS.index("int8 compute floor ms")] == "n/a"
    assert cells[roofline.HEADERS.index("isoserve / int8 floor")] == "n/a"
    assert "int8 n/a;" in roofline.table(run)
    measured = {**row, "int8_compute_floor_s": 0.0107, "measured_over_int8_floor": 4.2}
    cells = roofline.cells(measured)
    assert cells[roofline.HEADERS.index("int8 compute floor ms")] == "10.70"
    assert cells[roofline.HEADERS.index("isoserve / int8 floor")] == "4.20x"
    assert "int8 0.880 TOP/s;" in roofline.table({**run, "int8_peak_ops": 8.8e11, "results": [measured]})


def test_weight_bytes_read_follow_the_tiers(tiny_checkpoint):
    # A Q4_1 file's projections are read as their 4-bit blocks where a tier takes the batch
    # (5 bits a weight), and in bfloat16 above: the floor of what the step reads.
    from isoserve.bench.roofline import model_costs, weight_bytes_read
    from isoserve.model.llama import LlamaModel

    ckpt = tiny_checkpoint
    model = LlamaModel(ckpt.config, ckpt.weights, torch.bfloat16)
    dense = model_costs(ckpt.config, ckpt.weights, torch.bfloat16)["weight_bytes"]
    assert weight_bytes_read(model, 64) == dense  # no tier takes 64 rows
    projection_params = sum(p.out_features * p.in_features for layer in model.layers
                            for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    head = model.lm_head.out_features * model.lm_head.in_features * 2  # the tiny file's head is F32
    small = dense - 2 * projection_params - head
    assert weight_bytes_read(model, 1) == pytest.approx(projection_params * 5 / 8 + head + small, rel=0.01)


def test_build_llama_server_script_is_valid_bash():
    script = ROOT / "bench" / "build_llama_server.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "set -euo pipefail" in script.read_text()


def test_model_costs_count_parameters_not_their_quantized_companions(tiny_llama_dir):
    from isoserve.bench.roofline import model_costs
    from isoserve.model import int4, q8_0
    from isoserve.model.loader import load_checkpoint

    ckpt = load_checkpoint(str(tiny_llama_dir), torch.bfloat16)
    plain = model_costs(ckpt.config, ckpt.weights, torch.bfloat16)
    name = "model.layers.0.mlp.down_proj.weight"
    rows, cols = ckpt.weights[name].shape
    with_blocks = dict(ckpt.weights)
    for suffix, shape in int4.companion_shapes(rows, cols).items():
        with_blocks[name + suffix] = torch.zeros(shape, dtype=torch.uint8)
    embed = "model.embed_tokens.weight"
    for suffix, shape in q8_0.companion_shapes(*ckpt.weights[embed].shape).items():
        with_blocks[embed + suffix] = torch.zeros(shape, dtype=torch.int8)
    assert model_costs(ckpt.config, with_blocks, torch.bfloat16) == plain


def test_prefill_times_each_engine_on_every_prompt(tiny_llama_dir, tmp_path, capsys):
    # isoserve in float32, transformers in the CPU's own choice (--peer-dtype auto): the peer
    # the targets name runs in bfloat16 wherever the CPU computes in it natively.
    out = tmp_path / "prefill.json"
    rc = isoserve_main(["bench", "--prefill", "--model", str(tiny_llama_dir), "--prompt-tokens", "24",
                        "--repeats", "3", "--peers", "transformers", "--dtype", "float32", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "== prefill:" in printed and f"transformers' model for {tiny_llama_dir} ({dtype_name('auto')})" in printed
    data = json.loads(out.read_text())
    assert (data["dtype"], data["peer_dtype"]) == ("float32", dtype_name("auto"))
    assert data["peers"] == ["isoserve", "transformers"]
    for result in data["results"].values():
        assert len(result["seconds"]) == 3 and all(s > 0 for s in result["seconds"])
        assert result["tokens_per_s"] == pytest.approx(24 / result["median_seconds"])
    assert data["ratios"]["isoserve/transformers"] == pytest.approx(
        data["results"]["isoserve"]["tokens_per_s"] / data["results"]["transformers"]["tokens_per_s"])


def test_the_router_and_the_bench_client_run_on_uvloop():
    """event_loop.run is the loop `isoserve serve`, `isoserve bench`, the soak and the probe run
    on: uvloop, which the install brings (pyproject), not asyncio's slower default."""
    import asyncio

    import uvloop

    from isoserve import event_loop

    async def loop_type():
        return type(asyncio.get_running_loop())

    assert event_loop.run(loop_type()) is uvloop.Loop


def test_free_ports_stay_out_of_the_ephemeral_range_and_are_never_handed_out_twice():
    """A server binds its port seconds after the harness picks it; a port from the ephemeral
    range can be taken meanwhile as the local end of an outgoing connection (CI saw the router
    fail to bind one, 'Address already in use')."""
    import socket

    from isoserve.bench.local_server import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low or high < p <= 65535 for p in ports)
    with socket.socket() as s:  # each is bindable right after being picked
        s.bind(("127.0.0.1", free_port()))
