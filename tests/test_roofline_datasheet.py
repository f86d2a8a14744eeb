"""Chapter 9's roofline at two yardsticks: the measured bandwidth and the GPU's datasheet figure,
checked by hand on a toy floor and on the H200 run the issue quotes (58.3 % of the roofline at
the measured 4.10 TB/s is 49.8 % at the datasheet's 4.8 TB/s)."""
from __future__ import annotations

import pytest
import torch

from minivllm import ModelConfig
from minivllm.course.bench.roofline import DATASHEET_BANDWIDTH, datasheet_bandwidth, decode_floor, roofline_shares

pytestmark = pytest.mark.ch09


def toy_floor(bandwidth: float):
    config = ModelConfig(model_type="llama", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=2, max_position_embeddings=64)
    return decode_floor(config, torch.bfloat16, [3, 5], [2, 4], bandwidth)


def test_the_datasheet_table_names_the_gpus_the_project_compares():
    # The vendors' figures (TB/s), by the names torch.cuda.get_device_name gives.
    assert datasheet_bandwidth("NVIDIA H200") == 4.8e12
    assert datasheet_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12  # SXM
    assert datasheet_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert datasheet_bandwidth("NVIDIA A100-SXM4-40GB") == 1.555e12
    assert datasheet_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert datasheet_bandwidth("NVIDIA GeForce RTX 4070 Laptop GPU") == 0.256e12
    assert datasheet_bandwidth("cpu (x86_64, 2 threads)") is None
    assert all(1e11 < b < 1e13 for b in DATASHEET_BANDWIDTH.values())
    with pytest.raises(ValueError):
        datasheet_bandwidth(None)


def test_both_shares_by_hand():
    measured, datasheet = 1000.0, 1600.0
    floor = toy_floor(measured)
    seconds = 2 * floor.seconds  # half as fast as the floor at the measured bandwidth
    shares = roofline_shares(floor, seconds, datasheet)
    assert shares["share_of_roofline"] == pytest.approx(0.5)
    # The same bytes over the datasheet's bandwidth take 1000 / 1600 of the time: a stricter yardstick.
    assert shares["share_of_datasheet_roofline"] == pytest.approx(floor.total_bytes / 1600.0 / seconds)
    assert shares["share_of_datasheet_roofline"] == pytest.approx(0.5 * 1000 / 1600)
    assert roofline_shares(floor, seconds, None)["share_of_datasheet_roofline"] is None


def test_the_h200_run_the_issue_quotes():
    """The nano workload on the H200 (benchmarks/results/09_roofline_cuda.json): 15.26 TB in
    6.388 s; 58.3 % of the floor at the measured 4.0986 TB/s, 49.8 % at the datasheet's 4.8."""
    floor = toy_floor(4.0986e12)
    seconds = floor.total_bytes / 4.0986e12 / 0.583  # a run at 58.3 % of the measured roofline
    shares = roofline_shares(floor, seconds, datasheet_bandwidth("NVIDIA H200"))
    assert shares["share_of_roofline"] == pytest.approx(0.583)
    assert shares["share_of_datasheet_roofline"] == pytest.approx(0.498, abs=5e-4)


@pytest.mark.parametrize("seconds, datasheet", [(0.0, 1.0), (-1.0, 1.0), (True, 1.0), ("1", 1.0), (1.0, 0.0),
                                                (1.0, -5.0), (1.0, True), (1.0, "4.8e12")])
def test_bad_arguments_are_refused(seconds, datasheet):
    with pytest.raises(ValueError):
        roofline_shares(toy_floor(1000.0), seconds, datasheet)
